"""TLM: masking rates of both stage-1 streams counted over 100k tokens (15% of non-special
tokens chosen; of those 80% [MASK], 10% random, 10% kept; special tokens never chosen, [UNK]
included), the BM25 cache telling corpora and settings apart, and the defaults against the
official scripts (train.sh / finetune.sh)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from attnlab.config import ConfigError
from attnlab.recipes.tlm_config import cache_dir, load_index, load_tlm_config
from attnlab.tlm.objective import IGNORE, ExternalCollator, MaskedTaskCollator, encode_passages

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    from attnlab.recipes.tlm_train import load_tokenizer

    return load_tokenizer()


def _collator(tok, seed):
    from attnlab.tasks.mlm import MlmTask

    return MlmTask().collator(tok, seed=seed)


def _texts(tok, n_passages: int, seed: int = 0) -> list[str]:
    """Passages of whole vocabulary words, 20-120 words each, with planted [UNK]-makers
    (U+2603) and special-token strings ("[MASK]", "[SEP]") that must never be chosen."""
    rng = random.Random(seed)
    words = [w for w in tok.get_vocab() if w.isalpha() and w.islower() and len(w) > 2]
    out = []
    for _ in range(n_passages):
        ws = rng.choices(words, k=rng.randint(20, 120))
        for j in rng.sample(range(len(ws)), 3):
            ws[j] = rng.choice(["\u2603", "[MASK]", "[SEP]"])
        out.append(" ".join(ws))
    return out


def _count(tok, batches):
    """(eligible, chosen, [MASK], random, kept, special chosen) over (original ids, batch)."""
    special = torch.tensor(sorted(tok.all_special_ids))
    c = dict(eligible=0, chosen=0, mask=0, random=0, kept=0, special_chosen=0, specials=0)
    for orig, batch in batches:
        ids, lab = batch["input_ids"], batch["mlm_labels"]
        width = ids.shape[1]
        o = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in orig])  # [b, n]
        chosen = lab != IGNORE
        spec = torch.isin(o, special)
        assert torch.equal(lab[chosen], o[chosen])  # targets are the original tokens
        c["specials"] += int(spec.sum())
        c["special_chosen"] += int((chosen & spec).sum())
        c["eligible"] += int((~spec).sum())
        c["chosen"] += int(chosen.sum())
        new, old = ids[chosen], o[chosen]
        c["mask"] += int((new == tok.mask_token_id).sum())
        c["kept"] += int((new == old).sum())
        c["random"] += int(((new != tok.mask_token_id) & (new != old)).sum())
    return c


def _assert_rates(c):
    """Binomial tolerance of 4.5 sd (the masks are seeded, so this is not flaky)."""
    n, k = c["eligible"], c["chosen"]
    assert n >= 100_000
    assert abs(k / n - 0.15) < 4.5 * math.sqrt(0.15 * 0.85 / n), c
    assert abs(c["mask"] / k - 0.8) < 4.5 * math.sqrt(0.8 * 0.2 / k), c
    # a random replacement equal to the original counts as kept (p ~ 1/30522 of 10%)
    assert abs(c["random"] / k - 0.1) < 4.5 * math.sqrt(0.1 * 0.9 / k), c
    assert abs(c["kept"] / k - 0.1) < 4.5 * math.sqrt(0.1 * 0.9 / k), c
    assert c["special_chosen"] == 0 and c["specials"] > 3000, c


def test_external_stream_masking_rates_over_100k_tokens(tok):
    feats = encode_passages(_texts(tok, 1600), tok, 128)
    collate = ExternalCollator(_collator(tok, seed=0))
    batches = [([f["input_ids"] for f in feats[s:s + 32]], collate(feats[s:s + 32]))
               for s in range(0, len(feats), 32)]
    c = _count(tok, batches)
    assert c["specials"] > 2 * len(feats)  # [UNK], [MASK], [SEP] strings and padding too
    _assert_rates(c)


def test_task_stream_masking_rates_over_100k_tokens(tok):
    texts = _texts(tok, 1600, seed=1)
    enc = tok(texts, truncation=True, max_length=128)
    feats = [{"input_ids": ids, "attention_mask": [1] * len(ids),
              "token_type_ids": [0] * len(ids), "labels": i % 2, "example_index": i}
             for i, ids in enumerate(enc["input_ids"])]
    collate = MaskedTaskCollator(_collator(tok, seed=5), frozenset(tok.all_special_ids))
    batches = []
    for s in range(0, len(feats), 32):
        batch = collate(feats[s:s + 32])
        assert batch["labels"].tolist() == [f["labels"] for f in feats[s:s + 32]]
        batches.append(([f["input_ids"] for f in feats[s:s + 32]], batch))
    _assert_rates(_count(tok, batches))


# ----------------------------------------------------------------------------- BM25 cache


def _cfg(tmp, corpus, *extra):
    return load_tlm_config(None, ["task.name=cola", "task.data_dir=builtin",
                                  f"output_dir={tmp / 'runs'}", f"retrieval.corpus={corpus}",
                                  *extra])


def _corpus(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_two_corpora_of_one_name_get_their_own_index(tmp_path):
    a = _corpus(tmp_path / "en" / "docs.jsonl", ["alpha beta gamma", "delta epsilon"])
    b = _corpus(tmp_path / "de" / "docs.jsonl", ["der hund bellt", "die katze", "ein fisch"])
    ia, ib = (load_index(_cfg(tmp_path, c), progress=False) for c in (a, b))
    assert cache_dir(_cfg(tmp_path, a)) != cache_dir(_cfg(tmp_path, b))
    assert (len(ia), len(ib)) == (2, 3) and ib.passage(0).text == "der hund bellt"


def test_an_explicit_cache_dir_refuses_an_index_of_other_data(tmp_path):
    a = _corpus(tmp_path / "a.jsonl", ["alpha beta gamma", "delta epsilon"])
    cache = tmp_path / "cache"
    first = load_index(_cfg(tmp_path, a, f"retrieval.cache_dir={cache}"), progress=False)
    assert first.meta["source"]["passage_tokens"] == 128
    again = load_index(_cfg(tmp_path, a, f"retrieval.cache_dir={cache}"), progress=False)
    assert len(again) == 2  # the same data: loaded
    for extra, what in (("retrieval.k1=2.0", "k1"), ("retrieval.b=0.5", "b"),
                        ("retrieval.passage_tokens=64", "passage_tokens")):
        with pytest.raises(ConfigError, match=what) as e:
            load_index(_cfg(tmp_path, a, f"retrieval.cache_dir={cache}", extra), progress=False)
        assert "\n" not in str(e.value)
    b = _corpus(tmp_path / "b.jsonl", ["another corpus entirely"])
    with pytest.raises(ConfigError, match="corpus"):
        load_index(_cfg(tmp_path, b, f"retrieval.cache_dir={cache}"), progress=False)


def test_a_folder_corpus_is_read_and_an_edit_inside_it_is_another_index(tmp_path):
    """The issue's "JSONL or text folders": a folder of .jsonl/.txt files passes the config
    check and is indexed whole; adding a file inside gives another cache folder (its
    fingerprint counts the files read, their sizes and latest mtime), never the old index."""
    import os

    folder = tmp_path / "corpus"
    _corpus(folder / "a.jsonl", ["alpha beta gamma", "delta epsilon"])
    (folder / "b.txt").write_text("zeta eta theta\n\niota kappa\n")
    (folder / ".hidden.txt").write_text("never read\n")
    cfg = _cfg(tmp_path, folder)
    index = load_index(cfg, progress=False)
    assert len(index) == 4
    before = cache_dir(cfg)
    (folder / "c.txt").write_text("lambda mu\n")
    os.utime(folder / "c.txt", ns=(1, 1))  # an old mtime: the count and size still differ
    after = cache_dir(_cfg(tmp_path, folder))
    assert after != before and len(load_index(_cfg(tmp_path, folder), progress=False)) == 5


# ----------------------------------------------------------------------------- defaults


def test_defaults_are_the_official_scripts_and_the_papers_small_scale_model(tmp_path):
    from attnlab.models import encoder_config
    from attnlab.train.optim import warmup_steps

    cfg = load_tlm_config(None, ["task.name=cola", "task.data_dir=builtin",
                                 "external=none", f"output_dir={tmp_path}"])
    s1, s2 = cfg.stage1, cfg.stage2
    # train.sh: 150K steps, 32 per GPU x 8 GPUs, lr 1e-4, wd 0.01, warmup 10K, ratio 999, w 20
    assert (s1.steps, s1.batch_size, s1.lr, s1.weight_decay) == (150_000, 256, 1e-4, 0.01)
    assert warmup_steps(s1.warmup_ratio, s1.steps) == 10_000
    assert (s1.rho1, s1.rho2, s1.max_grad_norm) == (999, 20.0, None)
    # finetune.sh: 30K steps, 4 per GPU x 8 GPUs, lr 2e-5, wd 0, warmup 3K, eval every 1K
    assert (s2.max_steps, s2.batch_size, s2.lr, s2.weight_decay) == (30_000, 32, 2e-5, 0.0)
    assert warmup_steps(s2.warmup_ratio, s2.max_steps) == 3_000 and s2.eval_every == 1000
    bert = encoder_config(cfg.model.size)  # BERT-Base: the paper's small-scale TLM
    assert (bert.num_hidden_layers, bert.hidden_size, bert.num_attention_heads,
            bert.intermediate_size) == (12, 768, 12, 3072)
    assert cfg.model.max_length == 128 and cfg.retrieval.k is None  # K by default_k
