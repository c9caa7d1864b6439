"""Every registered mechanism survives save_pretrained / load_pretrained in a tiny BERT.

Each mechanism's own ``example`` spec (as in tests/mechanisms/test_contract.py) on every
head of a tiny BertForSequenceClassification (3 layers, 4 heads of 8). Its state must come
back from the saved folder alone: random features, rotations, random patterns, k-means
draws and fixed random tables are either saved or derived from the config's seed, never
from the global RNG, which is in another state when the folder is loaded (reseeded here,
and a fresh process with another hash seed in the last test). Length-bound mechanisms
(``caps.needs_max_len``) are sized by ``max_len=MAX_LEN``, which surgery.json records.

Also ``copy.deepcopy`` and pickling the whole model (``torch.save(model)``), as EMA
teachers, ensembles and trainers do: before, a pickled model failed at its first forward
for every mechanism (the per-forward state lost its task ids on unpickling), and pickling
failed for ``random`` and ``sparse_transformer`` (a closure as an attribute).

Tolerance: none; reloaded eval-mode outputs are bit-identical (``torch.equal``).
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_tiny_bert

import attnlab
from attnlab import load_pretrained, save_pretrained
from attnlab.core import mechanism_class
from attnlab.hf import applied_report, apply_plan, set_task_id
from attnlab.hf.backend import forward_state

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = attnlab.list_mechanisms()
MAX_LEN = 16  # HeadDims.max_len of length-bound mechanisms; the batch is 12 tokens long
LABELS = torch.tensor([0, 1, 0])


def _batch() -> dict[str, torch.Tensor]:
    """input_ids [3, 12] with lengths 12, 7, 3 (pad id 0), as conftest's padded_batch."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (3, 12), generator=g)
    mask = (torch.arange(12)[None, :] < torch.tensor([12, 7, 3])[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def _planned(name: str):
    """Tiny BERT classifier with ``name``'s example spec on every head, and its report."""
    model = make_tiny_bert("BertForSequenceClassification", num_labels=2)
    report = apply_plan(model, f"all:all:{mechanism_class(name).example}", max_len=MAX_LEN)
    return model, report


def _mechanism_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if ".attnlab." in k}


def _train_one_step(model, batch) -> None:
    """One SGD step on the classification loss."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(**batch, labels=LABELS).loss
    loss.backward()
    opt.step()
    model.eval()


def _eval_logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def _load_elsewhere(path):
    """load_pretrained with the global RNG in another state than at save time."""
    torch.manual_seed(12345)
    torch.rand(7)
    return load_pretrained(path)


def _assert_same_state(loaded, model) -> None:
    """Same saved state, and same buffers, those left out of the state dict included
    (persistent=False: derived state, which the reload must derive alike)."""
    for what in ("state_dict", "named_buffers"):
        want, got = (dict(getattr(m, what)()) for m in (model, loaded))
        assert want.keys() == got.keys()
        differ = [k for k in want if not torch.equal(want[k], got[k])]
        assert not differ, f"{what} differs after reload: {differ[:5]}"


@pytest.mark.parametrize("name", NAMES)
def test_reload_is_bit_identical_under_another_rng_state(name, tmp_path):
    model, report = _planned(name)
    with torch.no_grad():  # mechanism weights that a reload from init would not reproduce
        for pname, p in model.named_parameters():
            if ".attnlab." in pname:
                p.add_(0.05 * torch.randn_like(p))
    batch = _batch()
    ref = _eval_logits(model, batch)
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "surgery.json").read_text())["max_len"] == MAX_LEN
    loaded = _load_elsewhere(tmp_path)
    assert applied_report(loaded).table == report.table
    assert applied_report(loaded).max_len == MAX_LEN
    _assert_same_state(loaded, model)
    assert torch.equal(_eval_logits(loaded, batch), ref)
    torch.manual_seed(54321)  # eval mode draws nothing from the global RNG
    assert torch.equal(_eval_logits(loaded, batch), ref)


@pytest.mark.parametrize("name", NAMES)
def test_reload_after_a_training_step(name, tmp_path):
    """Saved after one optimiser step (an eval forward before it, so that nothing computed
    at the first forward outlives a change of the weights): trained parameters and state
    updated in training (routing's centroids) come back, and so do the outputs."""
    model, _ = _planned(name)
    batch = _batch()
    before = _mechanism_state(model)
    _eval_logits(model, batch)
    _train_one_step(model, batch)
    after = _mechanism_state(model)
    if any(p.requires_grad for n, p in model.named_parameters() if ".attnlab." in n):
        assert any(not torch.equal(before[k], after[k]) for k in before), \
            "one training step left every mechanism parameter unchanged"
    ref = _eval_logits(model, batch)
    save_pretrained(model, tmp_path)
    loaded = _load_elsewhere(tmp_path)
    _assert_same_state(loaded, model)
    assert torch.equal(_eval_logits(loaded, batch), ref)


def _pickled(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name", NAMES)
def test_deepcopy_and_pickle_after_a_training_step(name):
    """A deep copy and a pickled model: same state, bit-identical outputs, and a per-forward
    state of their own (shared by their layers, not with the original's)."""
    model, _ = _planned(name)
    batch = _batch()
    _train_one_step(model, batch)
    ref = _eval_logits(model, batch)
    for twin in (copy.deepcopy(model), _pickled(model)):
        _assert_same_state(twin, model)
        assert torch.equal(_eval_logits(twin, batch), ref)
        holders = {id(m.forward_state) for m in twin.modules() if hasattr(m, "forward_state")}
        assert holders == {id(forward_state(twin))} != {id(forward_state(model))}


def test_copies_keep_the_task_ids():
    model = make_tiny_bert("BertForSequenceClassification", num_labels=2)
    apply_plan(model, "all:all:camtl_prior(tasks=3)", max_len=MAX_LEN)
    set_task_id(model, [2, 0, 1])
    batch = _batch()
    ref = _eval_logits(model, batch)
    for twin in (copy.deepcopy(model), _pickled(model)):
        assert torch.equal(forward_state(twin).task_ids, torch.tensor([2, 0, 1]))
        assert torch.equal(_eval_logits(twin, batch), ref)
        set_task_id(twin, None)  # the copy's ids are its own
    assert torch.equal(forward_state(model).task_ids, torch.tensor([2, 0, 1]))


@pytest.mark.parametrize("name", [n for n in NAMES if mechanism_class(n).caps.needs_max_len])
def test_length_bound_mechanism_keeps_its_max_len(name, tmp_path):
    """The reloaded mechanism is built for the saved max_len, not the model's 64: it refuses
    a longer input with the same clear error as before saving."""
    model, _ = _planned(name)
    save_pretrained(model, tmp_path)
    loaded = _load_elsewhere(tmp_path)
    ids = torch.randint(5, 100, (2, MAX_LEN + 4))
    for m in (model, loaded):
        with pytest.raises(ValueError, match=rf"built for at most {MAX_LEN} positions"):
            m(input_ids=ids)


_CHILD = """
import json, sys, torch
from attnlab import load_pretrained
batch = torch.load(sys.argv[1])
torch.manual_seed(987)
differ = []
for folder, name in json.loads(sys.argv[2]).items():
    model = load_pretrained(folder)
    with torch.no_grad():
        out = model(**batch).logits
    if not torch.equal(out, torch.load(folder + "/ref_logits.pt")):
        differ.append(name)
print(json.dumps(differ))
"""


def test_reload_in_a_fresh_process(tmp_path):
    """All mechanisms, trained one step, saved here and loaded by another Python process
    (another hash seed, another torch seed): the outputs are bit-identical."""
    batch = _batch()
    folders = {}
    for name in NAMES:
        model, _ = _planned(name)
        _train_one_step(model, batch)
        folder = tmp_path / name
        save_pretrained(model, folder)
        torch.save(_eval_logits(model, batch), folder / "ref_logits.pt")
        folders[str(folder)] = name
    torch.save(batch, tmp_path / "batch.pt")
    env = {**os.environ, "PYTHONHASHSEED": "4321", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "batch.pt"),
                          json.dumps(folders)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
