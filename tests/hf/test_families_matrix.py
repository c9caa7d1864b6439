"""Every encoder family attnlab knows, with every task head: plans, saving, tuners, errors.

Tiny random models built from local configs (hidden 32, 4 heads of 8, 2 layers; ModernBERT
3 layers: global, local, global with a window of +-2), no download, dropout off. Batches:
lengths 12, 7, 3 padded to 12 with the family's pad id, and single examples of length 1,
2 and 5. Families missing from the installed transformers are skipped.

Tolerances: the untouched model against a plan of ``softmax`` everywhere, on its own
"sdpa" attention: 1e-6 for outputs (every position) and gradients (the same kernel;
measured 0); on "eager" attention 1e-6 on real tokens (another kernel; measured up to
3e-8; ModernBERT's eager attention fills padded queries that see no key otherwise).
Padding invariance of a plan (a padded example against the same example alone) 1e-5
(measured up to 1.3e-6). A saved and reloaded model: bit-identical outputs. Outputs with
``output_attentions`` (the maps materialised, another kernel) against the host's or the
plan's own without: 1e-5 (measured up to 1.3e-6).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from torch import nn

from attnlab import load_pretrained, save_pretrained
from attnlab.hf import (
    Plan,
    PlanError,
    SurgeryError,
    UnsupportedModelError,
    applied_report,
    apply_plan,
    check_model_config,
    inspect_model,
)
from attnlab.hf.backend import AttnlabLayer, key_mask_from_hf
from attnlab.tuning import TaskInfo, count_parameters, list_tuners, resolve_tuning

# ModernBERT's local layers: a mechanism without a score pattern ignores the window, as
# docs/decisions.md #21 chose; the plans here put such mechanisms there on purpose.
pytestmark = [pytest.mark.filterwarnings("ignore:mechanism .* is not softmax over a pattern"),
              pytest.mark.usefixtures("one_thread")]

SMALL = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=37, max_position_embeddings=64, initializer_range=0.2)
BERTLIKE = dict(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# family -> (class-name prefix, config keywords)
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "bert": ("Bert", BERTLIKE),
    "roberta": ("Roberta", BERTLIKE),
    "xlm-roberta": ("XLMRoberta", BERTLIKE),
    "camembert": ("Camembert", BERTLIKE),
    "electra": ("Electra", {**BERTLIKE, "embedding_size": 16}),
    "ernie": ("Ernie", BERTLIKE),
    "roberta-prelayernorm": ("RobertaPreLayerNorm", BERTLIKE),
    "distilbert": ("DistilBert", dict(
        vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
        max_position_embeddings=64, initializer_range=0.2, dropout=0.0, attention_dropout=0.0,
        seq_classif_dropout=0.0, qa_dropout=0.0)),
    "modernbert": ("ModernBert", dict(
        SMALL, num_hidden_layers=3, global_attn_every_n_layers=2, local_attention=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0, classifier_dropout=0.0)),
}
# models outside arch.FAMILIES that take the generic path (one per kind of host)
GENERIC_CONFIGS: dict[str, tuple[str, dict]] = {
    "data2vec-text": ("Data2VecText", BERTLIKE),
    "markuplm": ("MarkupLM", BERTLIKE),  # builds its own additive mask, (1 - mask) * -10000
    "llama": ("Llama", dict(SMALL, num_key_value_heads=2, pad_token_id=0)),  # causal, GQA
}
HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
         "ForMaskedLM")
LENGTHS = (12, 7, 3)
BERT_STYLE_LAYERS = {"bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie"}


def _class(family: str, suffix: str):
    prefix, _ = {**FAMILY_CONFIGS, **GENERIC_CONFIGS}[family]
    return getattr(transformers, prefix + suffix, None)


def make(family: str, head: str = "ForSequenceClassification", impl: str | None = None,
         **overrides) -> nn.Module:
    """A tiny random model of ``family`` with ``head`` ("Model": the bare encoder), eval."""
    prefix, values = {**FAMILY_CONFIGS, **GENERIC_CONFIGS}[family]
    config_cls, model_cls = _class(family, "Config"), _class(family, head)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {prefix}{head}")
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**values, **overrides}))
    if impl is not None:
        model.set_attn_implementation(impl)
    return model.eval()


def make_batch(model: nn.Module, lengths=LENGTHS) -> dict[str, torch.Tensor]:
    """Random ids (5..99) padded with the model's pad id, and the attention mask."""
    n = max(lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (len(lengths), n), generator=g)
    mask = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return {"input_ids": torch.where(mask.bool(), ids, torch.full_like(ids, pad)),
            "attention_mask": mask}


def outputs(model: nn.Module, batch, **kw) -> list[torch.Tensor]:
    """Every floating-point tensor the model returns (logits, start/end logits, states)."""
    out = model(**batch, **kw)
    return [v for v in out.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]


def real(x: torch.Tensor, batch) -> torch.Tensor:
    """Per-token outputs [b, n, ...] with padded positions zeroed (sequence outputs as is)."""
    mask = batch["attention_mask"].bool()
    if x.dim() >= 2 and x.shape[:2] == mask.shape:
        return x * mask.view(*mask.shape, *([1] * (x.dim() - 2)))
    return x


def grads_of(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    sum(o.square().mean() for o in outputs(model, batch)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FAMILY_HEADS = [(f, h) for f in FAMILY_CONFIGS for h in HEADS]
PLANS = {
    "band+linear+talking": ["0:0,2:band(window=1)", "0:1:linear_elu", "1:all:talking_heads"],
    "gqa+performer+jat": ["0:all:gqa(kv_heads=2)", "1:0,1:performer(num_features=8)",
                          "1:2,3:jat(mask_pads=True)"],
    "mega+band": ["0:all:mega", "1:1,3:band(window=1)"],
}
PARAMETRISED_PLAN = ["0:0,2:band(window=1)", "1:all:talking_heads"]  # talking heads: weights


# ------------------------------------------------------------------- 1. softmax everywhere


@pytest.mark.parametrize("family,head", FAMILY_HEADS + [(g, "Model") for g in GENERIC_CONFIGS])
def test_softmax_plan_matches_the_untouched_model(family, head):
    model = make(family, head)
    batch = make_batch(model)
    planned = copy.deepcopy(model)
    report = apply_plan(planned, "all:all:softmax")
    assert planned.config._attn_implementation == "attnlab"
    assert model.config._attn_implementation != "attnlab"
    assert report.params_added == report.params_removed == 0
    for ref, out in zip(outputs(model, batch), outputs(planned, batch), strict=True):
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)  # padded positions too
    ref_grads, grads = grads_of(model, batch), grads_of(planned, batch)
    assert ref_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=0, msg=name)


# ------------------------------------------------------------------- 2. mixed mechanisms


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_mixed_plan_trains_on_padded_single_and_short_batches(family, plan):
    model = make(family, "ForTokenClassification")
    untouched = copy.deepcopy(model)
    report = apply_plan(model, PLANS[plan])
    assert set(Plan.parse(PLANS[plan]).mechanisms()) <= set(report.counts_by_name)
    added = [p for n, p in model.named_parameters() if ".attnlab." in n]
    for lengths in (LENGTHS, (5,), (1,), (2,), (2, 1)):
        batch = make_batch(model, lengths)
        model.train()
        logits = model(**batch).logits
        assert torch.isfinite(logits).all(), lengths
        model.zero_grad()
        logits.square().mean().backward()
        for name, p in model.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), (lengths, name)
        assert all(p.grad is not None for p in added), lengths
    model.eval()
    batch = make_batch(model)
    with torch.no_grad():
        full = model(**batch).logits
        assert (full - untouched(**batch).logits).abs().max() > 1e-2  # the plan acts
        for i, n in enumerate(LENGTHS):  # padding is invisible to the real tokens
            alone = model(**{k: v[i:i + 1, :n] for k, v in batch.items()}).logits
            torch.testing.assert_close(full[i, :n], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_apply_plan_to_a_model_in_eval_keeps_it_in_eval(family):
    """Installed mechanisms take the host's mode: performer draws fresh features at every
    training forward, so in a model left in training mode two eval calls differ."""
    model = make(family)
    apply_plan(model, ["0:0,1:performer(num_features=8)", "1:all:talking_heads"])
    assert not any(m.training for m in model.modules())
    batch = make_batch(model)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, model(**batch).logits)
    model.train()
    assert all(m.training for m in model.modules() if isinstance(m, AttnlabLayer))


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_custom_additive_4d_mask_masks_padding_as_the_host_does(family):
    """A hand-made 4-D additive mask in the BERT convention (0 keep, -10000 drop)."""
    model = make(family, "ForTokenClassification")
    batch = make_batch(model)
    n = batch["input_ids"].shape[1]
    mask4 = ((1.0 - batch["attention_mask"][:, None, None, :].float()) * -10000.0).expand(
        -1, 1, n, n)
    ref = model(input_ids=batch["input_ids"], attention_mask=mask4).logits
    planned = copy.deepcopy(model)
    apply_plan(planned, "softmax")
    out = planned(input_ids=batch["input_ids"], attention_mask=mask4).logits
    torch.testing.assert_close(real(out, batch), real(ref, batch), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_additive_masks_drop_keys_in_every_convention(dtype):
    """-inf, the dtype's minimum and the legacy -10000 drop a key; 0 and a soft bias keep it."""
    drop = [float("-inf"), torch.finfo(dtype).min, -10000.0]
    row = torch.tensor([0.0, *drop, -3.0], dtype=dtype)  # [m = 5]
    keep = torch.tensor([True, False, False, False, True])
    assert torch.equal(key_mask_from_hf(row.expand(2, 5), 2, 5), keep.expand(2, 5))
    assert torch.equal(key_mask_from_hf(row.expand(2, 1, 5, 5), 2, 5), keep.expand(2, 5))


# ----------------------------------------------------------------------- 3. save and load


@pytest.mark.parametrize("family,head", FAMILY_HEADS)
def test_save_then_load_pretrained_gives_identical_outputs(family, head, tmp_path):
    model = make(family, head)
    # a K/V shrink (not on fused hosts), and three groups of heads, two of them with weights
    plan = ["0:all:mqa", "1:0,2:gaussian_prior", "1:1:sac", "1:3:linear_elu"]
    report = apply_plan(model, plan)
    with torch.no_grad():  # mechanism weights that a reload from init would not reproduce
        for name, p in model.named_parameters():
            if ".attnlab." in name:
                p.add_(0.05 * torch.randn_like(p))
    batch = make_batch(model)
    ref = outputs(model, batch)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert type(loaded) is type(model)
    assert not any(m.training for m in loaded.modules())
    assert applied_report(loaded).table == report.table
    for r, o in zip(ref, outputs(loaded, batch), strict=True):
        assert torch.equal(r, o)


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_plain_from_pretrained_loads_the_softmax_model_as_documented(family, tmp_path):
    """hf/saving.py: plain from_pretrained ignores the plan; silently without mechanism
    weights, reporting them as unexpected with them, refusing shrunk K/V projections."""
    cls = _class(family, "ForSequenceClassification")
    base = make(family)
    batch = make_batch(base)
    ref = base(**batch).logits
    for plan, folder in (("0:0,2:band(window=1)", "plain"),
                         ("1:all:talking_heads", "weights"), ("0:all:mqa", "shrunk")):
        model = copy.deepcopy(base)
        apply_plan(model, plan)
        save_pretrained(model, tmp_path / folder)
        added = {n for n, _ in model.named_parameters() if ".attnlab." in n}
        if folder == "shrunk" and not inspect_model(model).fused:
            with pytest.raises(RuntimeError, match="mismatched_sizes"):
                cls.from_pretrained(tmp_path / folder)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain, info = cls.from_pretrained(tmp_path / folder, output_loading_info=True)
        assert set(info["unexpected_keys"]) == added
        assert not info["missing_keys"] and not info["mismatched_keys"]
        assert plain.config._attn_implementation != "attnlab"
        torch.testing.assert_close(plain.eval()(**batch).logits, ref, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------- 4. tuners


def _tuner_spec(family: str, name: str) -> str:
    if name == "prefix":
        shift = family not in ("distilbert", "modernbert")  # embeddings without cache length
        return f"prefix(num_virtual_tokens=3, shift_positions={shift})"
    return name


def _expected_trainable(name: str, model: nn.Module, plan_params: set[int]):
    """Predicate (parameter name, parameter) -> whether ``name`` should train it, for the
    backbone (the head always trains). None: the tuner's own rule is not restated here."""
    layer_norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm)
                   for p in m.parameters()}
    rules = {
        "full": lambda n, p: True,
        "wo_sparse": lambda n, p: True,
        "bitfit": lambda n, p: n.endswith(".bias") and id(p) not in plan_params,
        "pasta": lambda n, p: ".pasta." in n,
        "adapter": lambda n, p: ".adapter." in n or id(p) in layer_norms,
        "prefix": lambda n, p: "attnlab_prefix" in n,
        "lora": lambda n, p: "lora_" in n,
        "diff_prune": lambda n, p: n.endswith((".w", ".log_alpha")),
    }
    return rules.get(name)


TUNER_CASES = [(family, name) for family in FAMILY_CONFIGS for name in sorted(list_tuners())]


@pytest.mark.parametrize("family,name", TUNER_CASES)
def test_tuner_on_a_plan_trains_what_it_says(family, name):
    model = make(family)
    plan = ["0:0,2:linear_elu" if name == "prefix" else PARAMETRISED_PLAN[0],
            *PARAMETRISED_PLAN[1:]]
    apply_plan(model, plan)
    plan_params = {id(p) for n, p in model.named_parameters() if ".attnlab." in n}
    backbone_total = sum(p.numel() for p in model.base_model.parameters())
    tuner, cfg = resolve_tuning(_tuner_spec(family, name))
    task = TaskInfo(kind="single", special_ids=(3, 4), pad_id=model.config.pad_token_id)
    if name == "adapter" and family not in BERT_STYLE_LAYERS:
        with pytest.raises(TypeError, match="adapters need BERT-style layers") as err:
            tuner.apply(model, cfg, task=task)
        assert "\n" not in str(err.value)
        return
    if name == "bitfit" and family == "modernbert":  # the default config has no biases
        with pytest.raises(UnsupportedModelError, match="no bias terms outside the task head"
                           ) as err:
            tuner.apply(model, cfg, task=task)
        assert "\n" not in str(err.value)
        assert all(p.requires_grad for p in model.parameters())  # left untouched
        return
    model = tuner.apply(model, cfg, task=task)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = {id(p) for p in inner.base_model.parameters()}
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert {n for n, _ in tuner.trainable_parameters(model)} == trainable
    head = {n for n, p in params.items() if id(p) not in backbone}
    rule = _expected_trainable(name, model, plan_params)
    if rule is not None:
        for n in set(params) - head:
            assert (n in trainable) == rule(n, params[n]), n
        assert head - {n for n in head if "original_module" in n} <= trainable  # peft's copy
    if name not in ("full", "wo_sparse", "diff_prune", "mae"):
        assert not trainable & {n for n, p in params.items() if id(p) in plan_params}
    # the counts `attnlab params` prints, against an independent count
    counts = count_parameters(model, tuner)
    unique = {id(p): p for p in params.values() if p.requires_grad}
    assert counts["trainable_total"] == sum(p.numel() for p in unique.values())
    assert counts["trainable_without_head"] == sum(
        p.numel() for i, p in unique.items() if i in backbone)
    assert counts["backbone_total"] == backbone_total
    # one step: the frozen weights stay, the trained ones move
    before = {n: p.detach().clone() for n, p in params.items()}
    batch = {**make_batch(inner), "labels": torch.tensor([0, 1, 0])}
    batch["input_ids"][:, 0] = 3  # special tokens for PASTA
    model.train()
    tuner.before_step(model, 0)
    aux = tuner.aux_loss(model)
    loss = model(**batch).loss + (aux if aux is not None else 0.0)
    loss.backward()
    torch.optim.SGD([p for _, p in tuner.trainable_parameters(model)], lr=0.1).step()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) or n in trainable, n
    assert [n for n in trainable - head if not torch.equal(params[n], before[n])]


@pytest.mark.parametrize("name", ["bitfit", "pasta", "adapter", "prefix"])
@pytest.mark.parametrize("family", [
    "bert", "roberta", "electra", "distilbert", "modernbert", "xlm-roberta", "camembert"])
def test_partial_tuners_keep_tied_word_embeddings_frozen(family, name):
    """XLM-R and CamemBERT register lm_head before the encoder, so the tied word embeddings
    are named lm_head.decoder.weight; they are the backbone's all the same."""
    if name == "adapter" and family not in BERT_STYLE_LAYERS:
        pytest.skip("adapters need BERT-style layers")
    model = make(family, "ForMaskedLM", **(
        {"attention_bias": True} if (family, name) == ("modernbert", "bitfit") else {}))
    apply_plan(model, PARAMETRISED_PLAN if name != "prefix" else "0:0,2:linear_elu")
    embeddings = model.get_input_embeddings().weight
    tuner, cfg = resolve_tuning(_tuner_spec(family, name))
    model = tuner.apply(model, cfg, task=TaskInfo(kind="single", special_ids=(3, 4)))
    assert not embeddings.requires_grad
    assert embeddings.numel() == 100 * (16 if family == "electra" else 32)
    counts = count_parameters(model, tuner)
    assert counts["trainable_without_head"] == sum(
        p.numel() for p in model.base_model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_full_tuning_counts_tied_word_embeddings_as_backbone(family):
    model = make(family, "ForMaskedLM")
    tuner, cfg = resolve_tuning("full")
    model = tuner.apply(model, cfg)
    counts = count_parameters(model, tuner)
    assert counts["trainable_without_head"] == counts["backbone_total"] == sum(
        p.numel() for p in model.base_model.parameters())


ROBERTA_BASE = 124_055_040  # RobertaModel without pooler: 39,000,576 embeddings + 12 layers
ROBERTA_HEAD = 768 * 768 + 768 + 768 * 2 + 2  # RobertaClassificationHead, 2 labels


@pytest.mark.parametrize("tuning,task,count", [
    ("pasta", "pair", 12 * 4 * 768),  # <s> A </s></s> B </s>: four special tokens
    ("bitfit", "pair", 12 * (4 * 768 + 3072 + 768 + 2 * 768) + 768),  # no pooler
    ("lora(r=8)", "single", 12 * 2 * (768 * 8 + 8 * 768)),  # query, value
    ("prefix(num_virtual_tokens=20)", "single", 20 * 12 * 2 * 768),
])
def test_attnlab_params_prints_the_closed_form_counts_on_roberta_base(tuning, task, count):
    from typer.testing import CliRunner

    from attnlab.cli import app

    res = CliRunner().invoke(app, ["params", "--model-config", "roberta-base", "--tuning",
                                   tuning, "--task-type", task])
    assert res.exit_code == 0, res.output
    assert f"trainable without head: {count:,}" in res.output
    assert f"trainable with head:    {count + ROBERTA_HEAD:,}" in res.output
    assert f"backbone (RobertaModel, head excluded): {ROBERTA_BASE:,}" in res.output
    assert f"= {100 * count / ROBERTA_BASE:.3f}%" in res.output


# ------------------------------------------------------- 5. attention implementations


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_plan_takes_over_eager_and_sdpa_models_and_returns_its_maps(family, impl):
    model = make(family, "ForTokenClassification", impl=impl)
    batch = make_batch(model)
    planned = copy.deepcopy(model)
    apply_plan(planned, "softmax")
    assert planned.config._attn_implementation == "attnlab"
    assert model.config._attn_implementation == impl
    ref = model(**batch, output_attentions=True)
    out = planned(**batch, output_attentions=True)
    torch.testing.assert_close(real(out.logits, batch), real(ref.logits, batch), atol=1e-5,
                               rtol=0)  # maps materialised: another kernel
    layers = inspect_model(model).num_layers
    assert len(out.attentions) == layers
    rows = batch["attention_mask"].bool()[:, None, :, None]  # real queries
    if impl == "eager":  # sdpa returns no maps; ours are eager's on every real query
        for r, o in zip(ref.attentions, out.attentions, strict=True):
            torch.testing.assert_close(o * rows, r * rows, atol=1e-6, rtol=0)
    mixed = copy.deepcopy(model)
    apply_plan(mixed, PLANS["band+linear+talking"])
    with torch.no_grad():
        plain = mixed(**batch).logits
        maps = mixed(**batch, output_attentions=True)
    torch.testing.assert_close(maps.logits, plain, atol=1e-5, rtol=0)
    assert [tuple(a.shape) for a in maps.attentions] == [(3, 4, 12, 12)] * layers
    keys = batch["attention_mask"].bool()[:, None, None, :]
    assert all(torch.equal(a * rows * ~keys, torch.zeros_like(a)) for a in maps.attentions)


# ---------------------------------------------------------------------------- 6. errors


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_plan_errors_name_the_problem_and_the_fix_and_change_nothing(family):
    model = make(family)
    layers = inspect_model(model).num_layers
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    fused = inspect_model(model).fused
    cases = [
        ("5:all:band(window=2)", PlanError,
         f"layer index 5 is out of range; the model has {layers} layers.*Fix the rule's layers"),
        ("0:7:band(window=2)", PlanError,
         "head index 7 is out of range; the model has 4 heads.*Fix the rule's heads"),
        ("0:all:gqa(kv_heads=3)", SurgeryError,
         r"needs kv_heads to divide the 4 query heads; use one of \[1, 2, 4\]"),
        ("0:all:head_size(dk=5)", SurgeryError,
         "not a fused Q/K/V projection; use one of those models" if fused else
         "must be multiples of 8: choose dk and dv as multiples of 2"),
        ("0:0,1:talking_heads", SurgeryError, "has scope 'layer'.*Give it heads: all"),
        ("0:all:band(windw=2)", PlanError, "did you mean 'window'"),
    ]
    for plan, error, message in cases:
        with pytest.raises(error, match=message) as err:
            apply_plan(model, plan)
        _one_line(err)
    assert model.config._attn_implementation == "sdpa"
    assert applied_report(model) is None
    assert all(torch.equal(v, before[n]) for n, v in model.state_dict().items())


UNSUPPORTED = {  # model class, config class, config keywords, what the message names
    "gpt2": ("GPT2Model", "GPT2Config", dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4),
             "found no self-attention modules"),
    "t5": ("T5EncoderModel", "T5Config",
           dict(vocab_size=100, d_model=32, num_layers=2, num_heads=4, d_ff=37, d_kv=8),
           "found no self-attention modules"),
    "bart": ("BartModel", "BartConfig", dict(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
        decoder_ffn_dim=37, max_position_embeddings=64), "attnlab supports single-stack"),
    "albert": ("AlbertModel", "AlbertConfig", dict(SMALL, embedding_size=16),
               "shares one attention module across all layers"),
    "deberta-v2": ("DebertaV2Model", "DebertaV2Config", SMALL,
                   "does not route through transformers' AttentionInterface"),
    "big_bird": ("BigBirdModel", "BigBirdConfig", SMALL,
                 "use attnlab's 'bigbird' mechanism on a BERT host instead"),
}


@pytest.mark.parametrize("kind", UNSUPPORTED)
def test_unsupported_models_get_one_line_naming_the_model_and_the_way_out(kind):
    model_name, config_name, values, message = UNSUPPORTED[kind]
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    model = model_cls(config_cls(**values))
    with pytest.raises(UnsupportedModelError, match=message) as err:
        apply_plan(model, "0:0:band(window=2)")
    text = _one_line(err)
    assert model_name in text
    assert "supported" in text.lower() or "instead" in text or "single-stack" in text
    assert model.config._attn_implementation != "attnlab"
    with pytest.raises(UnsupportedModelError) as err:
        check_model_config(model.config, "0:0:band(window=2)")
    _one_line(err)


def test_plans_parse_the_same_for_every_family():
    """A plan is plain data: the report of one plan lists the same table on every family."""
    tables = set()
    for family in FAMILY_CONFIGS:
        if _class(family, "Config") is None:
            continue
        report = apply_plan(make(family), Plan.parse(PARAMETRISED_PLAN))
        tables.add(tuple(tuple(row) for row in report.table[:2]))
    assert len(tables) == 1
