"""ListOps' generated trees checked from their definition (LRA's ListOps, Nangia & Bowman
2018): operators MIN, MAX, MED, SM (sum mod 10), 2..max_args arguments per operator,
depth at most max_depth, min_length < tokens < max_length, labels the value of the
expression. Labels are recomputed by a stack evaluator over the flat tokens written here
(MED as ``int(np.median(..))``, LRA's rounding); the trees are distinct and seeded.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from attnlab.tasks import listops as lo

OPS = ("[MIN", "[MAX", "[MED", "[SM")  # LRA's OPERATORS, in its order


def stack_value(source):
    """An evaluator: a stack over the flat tokens of the Source."""
    stack = [[]]
    for tok in source.replace("(", " ").replace(")", " ").split():
        if tok in OPS:
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            stack[-1].append({"[MIN": min(args), "[MAX": max(args),
                              "[MED": int(np.median(args)), "[SM": sum(args) % 10}[op])
        else:
            stack[-1].append(int(tok))
    (value,) = stack[0]
    return value


def shape(source):
    """(depth, argument counts) of a Source: depth 1 is the root."""
    depth, deepest, counts, open_args = 0, 0, [], []
    for tok in source.replace("(", " ").replace(")", " ").split():
        if tok in OPS:
            if open_args:
                open_args[-1] += 1
            open_args.append(0)
            depth += 1
            deepest = max(deepest, depth)
        elif tok == "]":
            counts.append(open_args.pop())
            depth -= 1
        else:
            open_args[-1] += 1
            deepest = max(deepest, depth + 1)
    return deepest, counts


@pytest.mark.parametrize("seed, sizes, min_length, max_length, max_depth, max_args", [
    (11, (1500, 300, 200), 5, 80, 6, 10),  # 2,000 trees of LRA's arity, depth 6
    (4, (150, 25, 25), 500, 2000, 10, 10),  # LRA's own lengths, fewer trees
    (2, (800, 100, 100), 1, 25, 4, 3),  # shallow and narrow: the leaf at max_depth
])
def test_trees_follow_the_definition(seed, sizes, min_length, max_length,
                                                   max_depth, max_args):
    splits = lo.generate_listops(*sizes, min_length=min_length, max_length=max_length,
                                 max_depth=max_depth, max_args=max_args, seed=seed)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == list(sizes)
    rows = splits["train"] + splits["dev"] + splits["test"]
    assert len(set(rows)) == len(rows)  # distinct across the splits
    again = lo.generate_listops(*sizes, min_length=min_length, max_length=max_length,
                                max_depth=max_depth, max_args=max_args, seed=seed)
    assert again == splits
    ops, arities = Counter(), Counter()
    for source, target in rows:
        assert stack_value(source) == target
        flat = source.replace("(", " ").replace(")", " ").split()
        assert min_length < len(flat) < max_length
        depth, counts = shape(source)
        assert depth <= max_depth and all(2 <= c <= max_args for c in counts)
        arities.update(counts)
        ops.update(t for t in flat if t in OPS)
    assert set(ops) == set(OPS) and set(arities) == set(range(2, max_args + 1))
    assert set(t for _, t in rows) == set(range(10))
