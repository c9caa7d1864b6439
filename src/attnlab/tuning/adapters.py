"""Houlsby bottleneck adapters.

Houlsby, Giurgiu, Jastrzebski, Morrone, de Laroussilhe, Gesmundo, Attariyan, Gelly,
"Parameter-Efficient Transfer Learning for NLP", ICML 2019.

Two adapters per layer, one after the attention output projection and one after the
feed-forward output projection, each applied to the sublayer output before the skip
connection and LayerNorm:

    h = Dropout(W_o x)                     # the host's sublayer output
    h = h + W_up f(W_down h)               # adapter: d -> m -> d, residual, f nonlinearity
    out = LayerNorm(h + x_skip)            # the host's skip + LayerNorm, unchanged

with bottleneck m = size or d // reduction. Houlsby initialise both projections near zero
(truncated normal, std 1e-2, biases 0) so each adapter starts near the identity. Trained:
adapters, every LayerNorm of the backbone, and the task head (as in the paper).
Extra parameters per layer: 2 * (2*d*m + d + m).

How: the host's sublayer-output modules (BERT-style ``attention.output`` and ``output``,
each with ``dense``, ``dropout`` and ``LayerNorm``) get their ``dropout`` replaced by
``DropoutThenAdapter(dropout, adapter)``. Placing the adapter after the dropout follows
AdapterHub's Houlsby implementation (the paper does not say where dropout goes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .base import (
    RequiresGradTuner,
    TaskInfo,
    TunerConfig,
    encoder_layers,
    finish_tuning,
    register_tuner,
    set_trainable,
    start_tuning,
)

_ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "swish": nn.SiLU, "tanh": nn.Tanh}


@dataclass(frozen=True, kw_only=True)
class AdapterConfig(TunerConfig):
    """Bottleneck adapters after the attention and feed-forward sublayers."""

    name = "adapter"
    reduction: int = 16  # d / m: bottleneck size as a fraction of hidden size (AdapterHub Houlsby)
    size: int | None = None  # m: explicit bottleneck size; overrides reduction (paper: 8, 64, 256)
    nonlinearity: Literal["relu", "gelu", "swish", "tanh"] = "swish"  # f (AdapterHub Houlsby)
    init_std: float = 1e-2  # std of the truncated-normal init of W_down, W_up (paper: 1e-2)
    train_layernorm: bool = True  # also train the backbone's LayerNorms, as the paper does

    def __post_init__(self) -> None:
        if self.reduction < 1:
            raise ValueError("reduction must be >= 1")
        if self.size is not None and self.size < 1:
            raise ValueError("size must be >= 1 (or None to use reduction)")


class Adapter(nn.Module):
    """h -> h + up(f(down(h))): [b, L, d] -> [b, L, d]."""

    def __init__(self, d: int, m: int, act: str, init_std: float) -> None:
        super().__init__()
        self.down = nn.Linear(d, m)
        self.act = _ACTS[act]()
        self.up = nn.Linear(m, d)
        for lin in (self.down, self.up):
            nn.init.trunc_normal_(lin.weight, std=init_std, a=-2 * init_std, b=2 * init_std)
            nn.init.zeros_(lin.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(self.act(self.down(h)))  # [b, L, d]


class DropoutThenAdapter(nn.Module):
    """Stands in for a sublayer's dropout: the host's dropout, then the adapter."""

    def __init__(self, dropout: nn.Module, adapter: Adapter) -> None:
        super().__init__()
        self.dropout = dropout
        self.adapter = adapter

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.dropout(h))


def _sublayer_outputs(layer: nn.Module) -> list[nn.Module]:
    """The attention-output and feed-forward-output modules of a BERT-style layer."""
    found: list[nn.Module] = []
    for path in ("attention.output", "output"):
        mod: object = layer
        for part in path.split("."):
            mod = getattr(mod, part, None)
        if not (isinstance(mod, nn.Module) and all(
            isinstance(getattr(mod, a, None), nn.Module) for a in ("dense", "dropout", "LayerNorm")
        )):
            raise TypeError(
                f"adapters need BERT-style layers ({type(layer).__name__} has no {path} with "
                "dense, dropout and LayerNorm); supported: BERT, RoBERTa, ELECTRA and kin"
            )
        found.append(mod)
    return found


@register_tuner(AdapterConfig)
class AdapterTuner(RequiresGradTuner):
    """Inserts two adapters per layer; trains adapters, LayerNorms and head."""

    def apply(self, model: nn.Module, cfg: AdapterConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        config: Any = model.config  # the Hugging Face config
        d = int(config.hidden_size)
        m = cfg.size or max(1, d // cfg.reduction)
        ref = next(model.parameters())
        new: list[nn.Module] = []
        for layer in encoder_layers(model):
            for sub in _sublayer_outputs(layer):
                if isinstance(sub.dropout, DropoutThenAdapter):
                    raise ValueError("this model already has adapters")
                adapter = Adapter(d, m, cfg.nonlinearity, cfg.init_std).to(
                    device=ref.device, dtype=ref.dtype)
                dropout = sub.dropout
                assert isinstance(dropout, nn.Module)  # checked by _sublayer_outputs
                sub.dropout = DropoutThenAdapter(dropout, adapter)
                new.append(adapter)
        adapter_params = {id(p) for a in new for p in a.parameters()}
        layer_norm_params = {
            id(p) for mod in model.modules() if isinstance(mod, nn.LayerNorm)
            for p in mod.parameters()
        } if cfg.train_layernorm else set()
        keep = [n for n, p in model.named_parameters()
                if id(p) in adapter_params or id(p) in layer_norm_params]
        set_trainable(model, keep)
        return finish_tuning(model, record)
