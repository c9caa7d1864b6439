"""Per-family knowledge of Hugging Face models: where the self-attention modules are.

``inspect_model(model) -> Host`` finds, in layer order, the self-attention modules whose
forward calls ``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` (so the "attnlab" function can
take over), with head count, head dim, maximum positions, the names of the Q/K/V
projections (or of the one fused Q/K/V projection), whether the model is causal, and the
window of each local (sliding-window) layer.

Known families are listed in ``FAMILIES`` (BERT, RoBERTa, ELECTRA, DistilBERT and the
BERT-layout clones; ModernBERT with its fused ``Wqkv``, see :mod:`attnlab.hf.fused`). Any
other model that routes its attention through the interface is handled generically when its
self-attention modules can be found by their projection names (``query/key/value``,
``q_lin/k_lin/v_lin``, ``q_proj/k_proj/v_proj``, or a fused ``Wqkv`` / ``qkv_proj``) and
there is one per hidden layer. Models known not to route through the interface get an error
that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PreTrainedModel

from .fused import FUSED_NAMES, layer_windows


class UnsupportedModelError(TypeError):
    """The model's attention cannot be replaced by attnlab; the message says why."""


@dataclass(frozen=True)
class Family:
    """How one model family lays out its self-attention modules."""

    attn_class_suffix: str  # class-name suffix of the self-attention module
    proj: tuple[str, str, str]  # attribute names of the Q, K, V projections
    heads_attr: str  # attribute on the module giving its head count
    head_dim_attr: str  # attribute on the module giving the head dim
    # output projection W_O, a path from the self-attention module ("../" = from its parent)
    out_proj: str = "../output.dense"


_BERT_LAYOUT = Family("SelfAttention", ("query", "key", "value"), "num_attention_heads",
                      "attention_head_size")

# model_type -> layout. All of these use BertSelfAttention-style modules (query/key/value,
# one per layer, `layer_idx` and `is_causal` set from `config.is_decoder`).
FAMILIES: dict[str, Family] = {
    "bert": _BERT_LAYOUT,
    "roberta": _BERT_LAYOUT,
    "xlm-roberta": _BERT_LAYOUT,
    "camembert": _BERT_LAYOUT,
    "electra": _BERT_LAYOUT,
    "ernie": _BERT_LAYOUT,
    "roberta-prelayernorm": _BERT_LAYOUT,
    "distilbert": Family("SelfAttention", ("q_lin", "k_lin", "v_lin"), "n_heads",
                         "attention_head_size", out_proj="out_lin"),
    # fused Wqkv, RoPE applied before the interface, alternating local/global layers
    "modernbert": Family("Attention", ("Wqkv", "Wqkv", "Wqkv"), "num_heads", "head_dim",
                         out_proj="Wo"),
}

_OWN_ATTENTION = (
    "keeps its own attention classes and does not route through transformers' "
    "AttentionInterface, so its attention cannot be swapped per head"
)
UNSUPPORTED: dict[str, str] = {
    "big_bird": _OWN_ATTENTION + " (use attnlab's 'bigbird' mechanism on a BERT host instead)",
    "longformer": _OWN_ATTENTION
    + " (use attnlab's 'longformer' mechanism on a BERT/RoBERTa host instead)",
    "reformer": _OWN_ATTENTION,
    "nystromformer": _OWN_ATTENTION,
    "deberta": _OWN_ATTENTION,
    "deberta-v2": _OWN_ATTENTION,
    "albert": "shares one attention module across all layers, so a per-layer plan cannot be "
    "installed",
}

_PROJ_TRIPLES = (("query", "key", "value"), ("q_lin", "k_lin", "v_lin"),
                 ("q_proj", "k_proj", "v_proj"), *((f, f, f) for f in FUSED_NAMES))


@dataclass(frozen=True)
class Host:
    """What surgery needs to know about a model (see module docstring)."""

    family: str  # FAMILIES key, or "generic"
    model_type: str
    base: PreTrainedModel  # innermost pretrained model holding every attention module
    attention: tuple[nn.Module, ...]  # self-attention modules, in layer order
    num_heads: int  # h (query heads)
    head_dim: int  # d
    max_len: int | None  # config.max_position_embeddings
    proj: tuple[str, str, str]  # Q, K, V projection attribute names (fused: one name x3)
    causal: bool
    fused: bool = False  # one fused Q/K/V projection (proj = its name 3 times): never shrunk
    windows: tuple[int | None, ...] = ()  # per layer: one-sided local window w, None = global

    @property
    def num_layers(self) -> int:
        return len(self.attention)


def _model_type(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "model_type", "") or "")


def _find_base(model: nn.Module, first_attn: nn.Module) -> PreTrainedModel:
    """Innermost PreTrainedModel that contains the attention modules (e.g. ``model.bert``)."""
    best = None
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and any(m is first_attn for m in sub.modules()):
            best = sub  # modules() is pre-order, so later hits are nested deeper
    if best is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers PreTrainedModel; attnlab plans "
            "apply to Hugging Face models"
        )
    return best


def _is_self_attention(module: nn.Module, proj: tuple[str, str, str]) -> bool:
    if getattr(module, "is_cross_attention", False) or "Cross" in type(module).__name__:
        return False
    return all(_is_linear(getattr(module, p, None)) for p in proj)


def _is_linear(layer: nn.Module | None) -> bool:
    """nn.Linear, or a wrapper around one (peft's LoRA layers keep it as ``base_layer``)."""
    return isinstance(layer, nn.Linear) or isinstance(getattr(layer, "base_layer", None),
                                                      nn.Linear)


def _heads_and_dim(module: nn.Module, config, family: Family | None) -> tuple[int, int]:
    heads = dim = None
    names_h = (family.heads_attr,) if family else ()
    names_d = (family.head_dim_attr,) if family else ()
    for name in (*names_h, "num_heads", "num_attention_heads", "n_heads"):
        if isinstance(getattr(module, name, None), int):
            heads = getattr(module, name)
            break
    if heads is None:
        heads = getattr(config, "num_attention_heads", None)
    for name in (*names_d, "head_dim", "attention_head_size"):
        if isinstance(getattr(module, name, None), int):
            dim = getattr(module, name)
            break
    if dim is None and heads:
        dim = getattr(config, "hidden_size", 0) // heads
    if not heads or not dim:
        raise UnsupportedModelError(
            f"cannot tell the head count / head dim of {type(module).__name__}; "
            "add its family to attnlab.hf.arch.FAMILIES"
        )
    return int(heads), int(dim)


def inspect_model(model: nn.Module) -> Host:
    """Find the self-attention modules of ``model`` and the facts surgery needs."""
    model_type = _model_type(model)
    if model_type in UNSUPPORTED:
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {model_type!r}) {UNSUPPORTED[model_type]}. "
            f"Supported families: {', '.join(sorted(FAMILIES))}, and other models whose "
            "attention routes through transformers' AttentionInterface."
        )
    family = FAMILIES.get(model_type)
    if family is not None:
        attn = [
            m for m in model.modules()
            if type(m).__name__.endswith(family.attn_class_suffix)
            and _is_self_attention(m, family.proj)
        ]
        proj = family.proj
    else:
        if isinstance(model, PreTrainedModel) and not type(model)._can_set_attn_implementation():
            raise UnsupportedModelError(
                f"{type(model).__name__} (model_type {model_type!r}) {_OWN_ATTENTION}"
            )
        attn, proj = [], _PROJ_TRIPLES[0]
        for triple in _PROJ_TRIPLES:
            found = [
                m for m in model.modules()
                if "Attention" in type(m).__name__ and _is_self_attention(m, triple)
            ]
            if found:
                attn, proj = found, triple
                break
    config = getattr(model, "config", None)
    if not attn:
        raise UnsupportedModelError(
            f"found no self-attention modules in {type(model).__name__} "
            f"(model_type {model_type!r}); supported: {', '.join(sorted(FAMILIES))}, and other "
            "models whose attention routes through transformers' AttentionInterface with "
            "query/key/value, q_lin/k_lin/v_lin or q_proj/k_proj/v_proj projections, or a "
            f"fused {'/'.join(FUSED_NAMES)} projection"
        )
    n_layers = getattr(config, "num_hidden_layers", getattr(config, "n_layers", None))
    if family is None and n_layers is not None and len(attn) != n_layers:
        raise UnsupportedModelError(
            f"found {len(attn)} attention modules in {type(model).__name__} but the config has "
            f"{n_layers} layers (cross-attention or an encoder-decoder?); attnlab supports "
            "single-stack models"
        )
    shapes = {_heads_and_dim(m, config, family) for m in attn}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"attention layers of {type(model).__name__} differ in (heads, head_dim): "
            f"{sorted(shapes)}; attnlab needs one shape for all layers"
        )
    heads, dim = shapes.pop()
    causal = any(bool(getattr(m, "is_causal", False)) for m in attn) or bool(
        getattr(config, "is_decoder", False)
    )
    max_len = getattr(config, "max_position_embeddings", None)
    return Host(
        family=model_type if family is not None else "generic",
        model_type=model_type,
        base=_find_base(model, attn[0]),
        attention=tuple(attn),
        num_heads=heads,
        head_dim=dim,
        max_len=int(max_len) if max_len else None,
        proj=proj,
        causal=causal,
        fused=proj[0] == proj[1],
        windows=layer_windows(attn, config),
    )


# Output projections of models outside FAMILIES, tried in order (see Family.out_proj).
_GENERIC_OUT_PROJ = ("o_proj", "out_proj", "out_lin", "Wo", "../output.dense", "dense")


def output_projections(model: nn.Module, host: Host | None = None
                       ) -> tuple[tuple[str, nn.Linear], ...]:
    """(qualified name, W_O) of every self-attention layer, in layer order.

    W_O maps the concatenated head outputs [.., h*dv] to the model width; head i owns its
    input columns i*dv:(i+1)*dv (``weight[:, i*dv:(i+1)*dv]``, ``dv = in_features / h``).
    """
    host = host if host is not None else inspect_model(model)
    family = FAMILIES.get(host.model_type) if host.family != "generic" else None
    paths = (family.out_proj,) if family is not None else _GENERIC_OUT_PROJ
    named = {id(m): n for n, m in model.named_modules()}
    modules = dict(model.named_modules())
    found = []
    for attn in host.attention:
        name = named[id(attn)]
        for path in paths:
            base, rel = name, path
            while rel.startswith("../"):
                base, rel = base.rpartition(".")[0], rel[3:]
            full = f"{base}.{rel}" if base else rel
            layer = modules.get(full)
            if layer is not None and _is_linear(layer):
                # peft's LoRA layers keep the Linear as base_layer
                lin = layer if isinstance(layer, nn.Linear) else layer.base_layer
                if isinstance(lin, nn.Linear) and lin.in_features % host.num_heads == 0:
                    found.append((full, lin))
                    break
        else:
            raise UnsupportedModelError(
                f"cannot find the output projection of {name} ({type(attn).__name__}; looked "
                f"for {', '.join(paths)}); add its family's out_proj to attnlab.hf.arch.FAMILIES"
            )
    return tuple(found)
