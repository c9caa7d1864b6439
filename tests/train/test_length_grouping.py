"""``train.group_by_length``: batches of similar lengths (Hugging Face's length grouping).

Reference: ``transformers.trainer_pt_utils.get_length_grouped_indices`` with the same
seeded generator, cut into batches; exact (integer indices)."""

import torch
from safetensors.torch import load_file

from attnlab.config import load_config
from attnlab.recipes.finetune import run_experiment
from attnlab.train.loop import epoch_batches


def _lengths(n=1000, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 129, (n,), generator=g).tolist()


def _padded(batches, lengths):
    return sum(max(lengths[i] for i in b) * len(b) for b in batches)


def test_grouped_batches_cover_every_example_once():
    lengths = _lengths()
    batches = epoch_batches(len(lengths), 32, seed=0, epoch=0, rank=0, world=1,
                            lengths=lengths)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert [len(b) for b in batches[:-1]] == [32] * (len(batches) - 1)
    assert len(batches) == len(epoch_batches(len(lengths), 32, 0, 0, 0, 1))


def test_grouped_batches_match_transformers_reference():
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = _lengths()
    seed, epoch = 5, 2
    ref = get_length_grouped_indices(
        lengths, 32, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    got = epoch_batches(len(lengths), 32, seed, epoch, 0, 1, lengths)
    assert got == [ref[i:i + 32] for i in range(0, len(ref), 32)]


def test_grouped_batches_are_seeded_and_cut_padding():
    lengths = _lengths()
    a = epoch_batches(len(lengths), 32, 0, 0, 0, 1, lengths)
    assert a == epoch_batches(len(lengths), 32, 0, 0, 0, 1, lengths)
    assert a != epoch_batches(len(lengths), 32, 0, 1, 0, 1, lengths)
    assert a != epoch_batches(len(lengths), 32, 1, 0, 0, 1, lengths)
    plain = epoch_batches(len(lengths), 32, 0, 0, 0, 1)
    # uniform lengths 3..128: a random batch of 32 is padded to ~125 (1.9x the real tokens),
    # a grouped one (megabatches of 7 batches here) to near its own lengths (1.17x)
    real = sum(lengths)
    assert _padded(plain, lengths) > 1.8 * real
    assert _padded(a, lengths) < 1.25 * real
    # the longest example is in the first batch (an out-of-memory shows at step 1)
    assert max(lengths) == max(lengths[i] for i in a[0])


def test_grouped_batches_shard_across_processes():
    lengths = _lengths(n=1001)
    shards = [epoch_batches(len(lengths), 8, 0, 0, r, 2, lengths) for r in range(2)]
    flat = [i for s in shards for b in s for i in b]
    assert len(flat) == len(set(flat)) == 1000  # one example dropped to shard evenly
    # batch k of both processes comes from the same sorted run: similar lengths
    for b0, b1 in zip(shards[0], shards[1], strict=True):
        assert abs(max(lengths[i] for i in b0) - max(lengths[i] for i in b1)) <= 10


def test_lengths_must_match_the_examples():
    import pytest

    with pytest.raises(ValueError, match="3 lengths for 4 examples"):
        epoch_batches(4, 2, 0, 0, 0, 1, [1, 2, 3])


BASE = ["task.data_dir=builtin", "model.name=scratch:tiny", "model.max_length=24",
        "train.batch_size=8", "train.max_steps=6", "train.eval_every=2", "train.log_every=1",
        "task.train_limit=64", "task.eval_limit=16", "train.keep_best=false",
        "optim.lr=1e-3", "train.group_by_length=true"]


def test_grouped_run_resumes_to_the_same_weights(tmp_path):
    def run(name, **kw):
        cfg = load_config(None, BASE + [f"name={name}", f"output_dir={tmp_path}"])
        return run_experiment(cfg, **kw)

    full = run("full")
    assert run("cut", stop_after=3)["interrupted"]
    resumed = run("cut", resume=True)
    assert resumed["steps"] == full["steps"] == 6
    a, b = (load_file(tmp_path / n / "tuned.safetensors") for n in ("full", "cut"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
