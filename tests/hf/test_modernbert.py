"""ModernBERT (fused Wqkv, rotary embeddings, alternating local/global layers) via attnlab.

Tiny random ModernBERT: 4 layers (global, local, global, local: global_attn_every_n_layers
2), hidden 64, 4 heads of 16, local_attention 4 (a local query i sees |i - j| <= 2), fp32,
eval mode. Batches have 16 tokens, so the window cuts most of every local row.

Tolerances: parity with the model's own "eager" and "sdpa" attention 1e-5 (fp32, the same
maths through other kernels), compared on real tokens only: in a local layer a padded query
far from the real tokens has no key at all, transformers and attnlab fill such rows
differently (attnlab: zeros), and no real token ever reads them. Equalities that are the
same computation (band cut to the window vs softmax in the window) 1e-6.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.core import mechanism_class
from attnlab.hf import apply_plan, fused, inspect_model
from attnlab.hf import backend as hf_backend
from attnlab.hf.surgery import SurgeryError

LENGTHS = (16, 9, 3)


def modernbert_config(**overrides):
    from transformers import ModernBertConfig

    values = dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, global_attn_every_n_layers=2, local_attention=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, embedding_dropout=0.0, attention_dropout=0.0,
        mlp_dropout=0.0,
    )
    values.update(overrides)
    return ModernBertConfig(**values)


def make_modernbert(cls_name: str = "ModernBertModel", seed: int = 0, impl: str = "sdpa",
                    **overrides):
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(modernbert_config(**overrides)).eval()
    model.set_attn_implementation(impl)
    return model


@pytest.fixture(scope="module")
def reference():
    return make_modernbert()


@pytest.fixture
def batch():
    """input_ids [3, 16], lengths 16, 9, 3 (pad id 0), and the attention mask."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (3, 16), generator=g)
    mask = (torch.arange(16)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def hidden(model, batch, **kw):
    with torch.no_grad():
        return model(**batch, **kw).last_hidden_state  # [b,n,hidden]


def assert_close_on_real_tokens(out, ref, batch, tol=1e-5):
    real = batch["attention_mask"].bool()  # [b,n]
    assert torch.isfinite(out[real]).all()
    torch.testing.assert_close(out[real], ref[real], atol=tol, rtol=tol)


# ------------------------------------------------------------------------------ the host


def test_inspect_finds_the_fused_layout(reference):
    host = inspect_model(reference)
    assert host.family == "modernbert" and host.fused and host.proj == ("Wqkv",) * 3
    assert (host.num_layers, host.num_heads, host.head_dim, host.max_len) == (4, 4, 16, 64)
    assert host.windows == (None, 2, None, 2)  # global, local (|i - j| <= 2), ...
    assert [type(a).__name__ for a in host.attention] == ["ModernBertAttention"] * 4
    assert host.base is reference and not host.causal


def test_q_and_k_arrive_rotated(reference, batch):
    """transformers applies RoPE before the interface call: the q, k attnlab receives are
    Wqkv's output rotated by the layer's (cos, sin), v is not rotated."""
    model = copy.deepcopy(reference)
    apply_plan(model, "softmax")
    attn = model.layers[2].attn  # a global layer
    seen = {}

    def grab_inputs(module, args, kwargs):
        seen["x"], seen["cos_sin"] = args[0], kwargs["position_embeddings"]

    def grab_qkv(module, args):
        seen["q"], seen["k"], seen["v"] = args[:3]

    attn.register_forward_pre_hook(grab_inputs, with_kwargs=True)
    attn.attnlab.register_forward_pre_hook(grab_qkv)
    hidden(model, batch)
    b, n, _ = seen["x"].shape
    qkv = attn.Wqkv(seen["x"]).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)  # [3,b,h,n,d]
    q, k, v = qkv.unbind(0)  # [b,h,n,d]
    cos, sin = (t[:, None] for t in seen["cos_sin"])  # [b|1,1,n,d]

    def rotate(x):
        half = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
        return x * cos + half * sin

    torch.testing.assert_close(seen["q"], rotate(q), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(seen["k"], rotate(k), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(seen["v"], v, atol=1e-6, rtol=1e-6)
    assert (seen["q"] - q).abs().max() > 1e-2  # the rotation is not the identity


# ---------------------------------------------------------------------------- parity


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_softmax_everywhere_equals_the_models_own_attention(reference, batch, impl, padded):
    if not padded:
        batch = {"input_ids": batch["input_ids"][:1], "attention_mask": batch["attention_mask"][:1]}
    own = copy.deepcopy(reference)
    own.set_attn_implementation(impl)
    ref = hidden(own, batch)
    model = copy.deepcopy(reference)
    report = apply_plan(model, [{"layers": "all", "heads": "all", "mechanism": "softmax"}])
    assert model.config._attn_implementation == "attnlab"
    assert report.counts == {"softmax": 16} and report.params_added == 0
    out = hidden(model, batch)
    assert torch.isfinite(out).all()  # padded rows too (zeros where a row has no key)
    assert_close_on_real_tokens(out, ref, batch)


def test_switching_to_attnlab_without_a_plan_keeps_the_window(reference, batch):
    model = copy.deepcopy(reference)
    model.set_attn_implementation("attnlab")
    assert_close_on_real_tokens(hidden(model, batch), hidden(reference, batch), batch)


def test_without_the_window_parity_breaks(reference, batch, monkeypatch):
    """Negative control: the 16-token batch really exercises the local window."""
    model = copy.deepcopy(reference)
    apply_plan(model, "softmax")
    monkeypatch.setattr(hf_backend, "local_pattern", lambda *args: None)
    out, ref = hidden(model, batch), hidden(reference, batch)
    real = batch["attention_mask"].bool()
    assert (out[real] - ref[real]).abs().max() > 1e-3


def test_local_layers_attend_inside_the_window(reference, batch):
    model = copy.deepcopy(reference)
    apply_plan(model, "softmax")
    with torch.no_grad():
        probs = model(**batch, output_attentions=True).attentions  # per layer [b,h,n,n]
    i, j = torch.arange(16)[:, None], torch.arange(16)[None, :]
    outside = (i - j).abs() > 2  # [n,n]
    for layer in (1, 3):
        assert probs[layer][..., outside].abs().max() == 0
    assert probs[0][0, :, outside].sum() > 1.0  # global layers see every key


# ---------------------------------------------------------------- other mechanisms


def test_band_inside_the_window_is_cut_to_it(reference, batch):
    """Decision 21: on a local layer a pattern mechanism is its pattern AND the window."""
    soft = copy.deepcopy(reference)
    apply_plan(soft, "softmax")
    wide = copy.deepcopy(reference)
    apply_plan(wide, "1,3:all:band(window=3)")  # band 3 within window 2 = window 2
    assert_close_on_real_tokens(hidden(wide, batch), hidden(soft, batch), batch, tol=1e-6)
    narrow = copy.deepcopy(reference)
    apply_plan(narrow, "1:0,2:band(window=1)")
    with torch.no_grad():
        probs = narrow(**batch, output_attentions=True).attentions[1]  # [b,h,n,n]
    i, j = torch.arange(16)[:, None], torch.arange(16)[None, :]
    assert probs[:, [0, 2]][..., (i - j).abs() > 1].abs().max() == 0
    assert probs[:, [1, 3]][..., (i - j).abs() == 2].sum() > 0  # softmax heads: window 2


def test_band_on_some_heads_runs_changes_the_output_and_trains(reference, batch):
    model = copy.deepcopy(reference).train()
    report = apply_plan(model, [{"layers": [0, 1], "heads": [0, 2],
                                 "mechanism": "band(window=2)"}])
    assert report.table[0] == ["band(window=2)", "softmax"] * 2
    assert report.table[2] == ["softmax"] * 4
    out = model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert (out.detach()[real] - hidden(reference, batch)[real]).abs().max() > 1e-3
    out[real].square().mean().backward()
    for layer in model.layers:
        g = layer.attn.Wqkv.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_non_pattern_mechanism_ignores_the_window_and_says_so(reference, batch, monkeypatch):
    model = copy.deepcopy(reference)
    apply_plan(model, "1,3:all:linear_elu")  # every head of both local layers
    fused._warn_unwindowed.cache_clear()
    with pytest.warns(UserWarning, match="'linear_elu' is not softmax over a pattern"):
        out = hidden(model, batch)
    assert (out - hidden(reference, batch)).abs().max() > 1e-3
    # the window plays no part in its heads: the same output with the window switched off
    monkeypatch.setattr(hf_backend, "local_pattern", lambda *args: None)
    assert_close_on_real_tokens(out, hidden(model, batch), batch, tol=1e-6)


def test_every_registered_mechanism_can_replace_a_modernbert_head(batch):
    real = batch["attention_mask"].bool()
    for name in attnlab.list_mechanisms():
        model = make_modernbert().train()
        scope = mechanism_class(name).caps.scope
        heads = "1,3" if scope == "head" else "all"
        rule = f"0-1:{heads}:{mechanism_class(name).example}"  # global + local layers
        if hasattr(mechanism_class(name), "adopt_projections"):  # replaces Q and K: refused
            with pytest.raises(SurgeryError, match="fused Q/K/V projection"):
                apply_plan(model, rule)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the window and linformer's k >= n notes
            # its example spec: defaults may need per-batch inputs (camtl_prior's task id)
            apply_plan(model, rule)
            out = model(**batch).last_hidden_state
        assert torch.isfinite(out[real]).all(), name
        out[real].square().mean().backward()
        g = model.layers[1].attn.Wqkv.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name


def test_mqa_keeps_the_fused_projection_and_pools_kv_heads(reference, batch):
    model = copy.deepcopy(reference)
    report = apply_plan(model, "0:all:mqa")
    assert report.params_removed == 0 and report.kv_heads == {}
    assert model.layers[0].attn.Wqkv.out_features == 3 * 64
    # equal to the K/V projection shrunk by mean-pooling (GQA uptraining) on a global layer
    shrunk = copy.deepcopy(reference)
    with torch.no_grad():
        w = shrunk.layers[0].attn.Wqkv.weight.view(3, 4, 16, 64)  # [qkv,h,d,hidden]
        w[1:] = w[1:].mean(1, keepdim=True)
    assert_close_on_real_tokens(hidden(model, batch), hidden(shrunk, batch), batch)


def test_task_head_and_save_load_round_trip(tmp_path, batch):
    model = make_modernbert("ModernBertForSequenceClassification", num_labels=3)
    apply_plan(model, ["all:0:band(window=1)", "1:all:talking_heads"])
    attnlab.save_pretrained(model, tmp_path)
    again = attnlab.load_pretrained(tmp_path)
    assert type(again).__name__ == "ModernBertForSequenceClassification"
    assert again.config._attn_implementation == "attnlab"
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).logits, model(**batch).logits,
                                   atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------- real checkpoint


def _offline_checkpoint() -> Path | None:
    env = os.environ.get("ATTNLAB_MODERNBERT")
    if env:
        return Path(env) if (Path(env) / "config.json").exists() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for repo in ("answerdotai/ModernBERT-base", "answerdotai/ModernBERT-large"):
        found = try_to_load_from_cache(repo, "model.safetensors")
        if isinstance(found, str):
            return Path(found).parent
    return None


@pytest.mark.slow
def test_real_modernbert_checkpoint_smoke():
    """The embedded-MiniLM smoke on a real ModernBERT, when one is on this machine."""
    path = _offline_checkpoint()
    if path is None:
        pytest.skip("no ModernBERT checkpoint offline: set ATTNLAB_MODERNBERT to a local "
                    "ModernBERT-base folder or put answerdotai/ModernBERT-base in the Hugging "
                    "Face cache (tests never download)")
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    sentences = ["Attention is all you need.",
                 "A much longer sentence, so that the first one is padded in this batch."]
    enc = dict(tok(sentences, padding=True, return_tensors="pt"))
    own = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    ours = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    apply_plan(ours, "softmax")
    assert_close_on_real_tokens(hidden(ours, enc), hidden(own, enc), enc, tol=1e-4)
    apply_plan(ours, "all:0-3:band(window=8)")
    assert torch.isfinite(hidden(ours, enc)).all()
