"""MQAR's construction checked row by row from its definition (the module docstring of
``attnlab.tasks.recall``, Zoology's MQAR): keys from 1..V/2-1 and values from V/2..V-1,
distinct within an example, laid out as ``k1 v1 k2 v2 ...``; one query per key in the even
slots after the context, labelled with its key's value at the query position; filler
elsewhere. Split seeds as Zoology's ``prepare_data`` draws them.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.tasks import recall as rc


@pytest.mark.parametrize("vocab_size, n, k, power_a, count, seed, filler", [
    (8192, 64, 8, 0.01, 200, 0, True),  # Zoology's defaults
    (300, 256, 16, 0.01, 40, 123, True),
    (100, 64, 4, 1.0, 100, 5, False),  # uniform slots, zeros kept
])
def test_examples_follow_the_construction(vocab_size, n, k, power_a, count, seed, filler):
    inputs, labels = rc.multiquery_ar(count, vocab_size=vocab_size, input_seq_len=n,
                                      seed=seed, power_a=power_a, num_kv_pairs=k,
                                      random_non_queries=filler)
    assert inputs.shape == labels.shape == (count, n)
    half = vocab_size // 2
    for row, lab in zip(inputs, labels, strict=True):
        keys, values = row[0:2 * k:2], row[1:2 * k:2]
        assert ((1 <= keys) & (keys < half)).all() and len(set(keys)) == k
        assert ((half <= values) & (values < vocab_size)).all() and len(set(values)) == k
        value_of = dict(zip(keys.tolist(), values.tolist(), strict=True))
        where = np.flatnonzero(lab != rc.IGNORE)
        assert len(where) == k and ((where - 2 * k) % 2 == 0).all() and (where >= 2 * k).all()
        assert sorted(row[where].tolist()) == sorted(keys.tolist())  # one query per key
        assert all(lab[i] == value_of[row[i]] for i in where)
        rest = np.ones(n, bool)
        rest[:2 * k], rest[where] = False, False
        if not filler:
            assert (row[rest] == 0).all()
        else:
            assert ((0 <= row[rest]) & (row[rest] < vocab_size)).all()
    again = rc.multiquery_ar(count, vocab_size=vocab_size, input_seq_len=n, seed=seed,
                             power_a=power_a, num_kv_pairs=k, random_non_queries=filler)
    np.testing.assert_array_equal(again[0], inputs)
    np.testing.assert_array_equal(again[1], labels)


@pytest.mark.parametrize("seed", [0, 1, 2024])
def test_split_seeds_are_zoologys_prepare_data(seed):
    state = np.random.get_state()
    try:
        np.random.seed(seed)  # prepare_data with one train and one test segment
        train = np.random.randint(0, 2**32 // 2, size=1)
        test = np.random.randint(2**32 // 2, 2**32, size=1)
    finally:
        np.random.set_state(state)
    seeds = rc.split_seeds(seed)
    assert seeds["train"] == int(train[0]) and seeds["dev"] == int(test[0])
    assert 2**31 <= seeds["test"] < 2**32 and seeds["test"] != seeds["dev"]


def test_query_slots_follow_the_power_law():
    """With a = 0.01 most queries sit right after the context: the slot frequencies match
    p(g) ~ a g^(a-1) drawn without replacement (checked by the share of the first slot)."""
    n, k = 128, 4
    _, labels = rc.multiquery_ar(3000, vocab_size=512, input_seq_len=n, num_kv_pairs=k, seed=7)
    slots = (np.argwhere(labels != rc.IGNORE)[:, 1] - 2 * k) // 2
    counts = np.bincount(slots, minlength=(n - 2 * k) // 2)
    assert counts[0] > counts[1] > counts[5] > counts[-1]
    assert counts[:k].sum() > 0.2 * counts.sum()  # a uniform law would put ~7% there
