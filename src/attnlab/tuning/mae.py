"""MAE: a mixture of attentive experts in every layer, trained by block coordinate descent.

Peng, Schwartz, Li, Smith, "A Mixture of h - 1 Heads is Better than h Heads", ACL 2020.

Multi-head attention is a sum over heads, MHA(x) = sum_j H_j + b_O, with H_j = A_j W_O^j
(A_j [n, dv] head j's attention output, W_O^j its block of the output projection). The paper
reads it as a uniform mixture of h experts, expert i being the layer with head i dropped and
the other heads rescaled:

    f_i = h/(h-1) sum_{j != i} H_j,          MHA = sum_i (1/h) f_i + b_O,

and MAE makes the weights input-dependent responsibilities g(x) (a softmax over the experts):

    MAE(x) = sum_i g_i(x) f_i + b_O.

Identity (what is computed): since sum_i g_i = 1,

    sum_i g_i f_i = h/(h-1) sum_j (sum_{i != j} g_i) H_j = sum_j w_j H_j,
    w_j = h (1 - g_j) / (h - 1),

so the mixture of h experts is one weight per head on the head's output before W_O; the h
expert forwards are never run. Uniform g = 1/h gives w = 1, the original layer; g = e_i gives
expert i alone (head i dropped, the rest scaled by h/(h-1)). Cost: the gate and one
[b, h] scaling per layer.

Gate. Responsibilities are per sequence, one gate per layer, a feed-forward network with one
ReLU hidden layer and a softmax over the h experts, read from the layer's input pooled over
the sequence: ``pool="mean"`` averages the non-padding positions (the paper's gate gives
one set of responsibilities per sequence from an average of the input representations),
``pool="cls"`` takes the [CLS] (first) position, BERT's sequence representation.
Deviation: the output layer starts at zero, so g = 1/h and a pretrained encoder starts out
computing exactly its own function (the paper trains from scratch); the hidden width
(``gate_hidden``, default the model width) is ours.

Training (the paper's block coordinate descent, Algorithm 1), alternating
- G steps (``g_steps``): the mixture's forward; only the gates' parameters train;
- F steps (``f_steps``): every sequence draws one expert per layer, i ~ g(x) (no gradient
  through the draw), and runs that expert alone; every parameter but the gates trains (the
  experts' parameters: attention, feed-forward, embeddings and the task head).
``expert_step="mixture"`` runs F steps on the mixture instead, all parameters (gates
included) training; ``schedule="joint"`` trains everything on the mixture in every step (the
paper's NoBCD ablation). With uniform responsibilities the F steps drop one random head per
layer and rescale (the paper's link to dropout). Evaluation always uses the mixture.

The switch happens in :meth:`MaeTuner.before_step`, which the training loop calls before
every micro-batch with the optimizer step's index: it sets ``requires_grad`` (the optimizer
skips parameters without a gradient) and whether the gates sample. Outside the loop a tuned
model is in the joint phase (everything trains on the mixture) until ``before_step`` or
:func:`set_phase` says otherwise.

Saving: ``attnlab.save_pretrained`` records the gates in ``rebuild.json`` and
``attnlab.load_pretrained`` adds them again (``attnlab.hf.saving.register_rebuilder``);
``save_tuned`` writes every weight (everything trains). Families: those ``attnlab.hf.arch``
finds a W_O for and whose self-attention module takes ``hidden_states`` and
``attention_mask`` (BERT, RoBERTa, ELECTRA and the other BERT-layout models).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..hf.arch import UnsupportedModelError, inspect_model, output_projections
from ..hf.backend import key_mask_from_hf
from ..hf.saving import mark_rebuild, register_rebuilder
from .base import (
    TUNERS,
    FinalizeStage,
    TaskInfo,
    TunerConfig,
    finish_tuning,
    load_exact,
    register_tuner,
    start_tuning,
    unwrap_peft,
)

GATE_ATTR = "mae_gate"  # self-attention module attribute holding its MaeGate
Phase = Literal["joint", "gate", "experts"]


@dataclass(frozen=True, kw_only=True)
class MaeConfig(TunerConfig):
    """Per-layer gates over the h drop-one-head experts; block coordinate descent."""

    name = "mae"
    pool: Literal["mean", "cls"] = "mean"  # gate input: layer input averaged (paper) or [CLS]
    gate_hidden: int | None = None  # gate's hidden ReLU width (None: model width; 0: linear)
    schedule: Literal["bcd", "joint"] = "bcd"  # alternate G and F steps (paper); joint: NoBCD
    g_steps: int = 1  # G steps (gates only, mixture forward) per cycle (paper: 1)
    f_steps: int = 1  # F steps (experts, gates frozen) per cycle (paper: 1)
    # F steps: "sample" one expert per sequence ~ g (paper) or "mixture" (gates train too)
    expert_step: Literal["sample", "mixture"] = "sample"

    def __post_init__(self) -> None:
        if self.pool not in ("mean", "cls"):
            raise ValueError(f"mae pool must be 'mean' or 'cls', not {self.pool!r}")
        if self.schedule not in ("bcd", "joint"):
            raise ValueError(f"mae schedule must be 'bcd' or 'joint', not {self.schedule!r}")
        if self.expert_step not in ("sample", "mixture"):
            raise ValueError("mae expert_step must be 'sample' or 'mixture', not "
                             f"{self.expert_step!r}")
        if self.g_steps < 1 or self.f_steps < 1:
            raise ValueError("mae g_steps and f_steps must be >= 1 (schedule='joint' for "
                             "no alternation)")
        if self.gate_hidden is not None and self.gate_hidden < 0:
            raise ValueError("mae gate_hidden must be >= 0 (0: a linear gate)")


def head_weights_from_gate(g: torch.Tensor) -> torch.Tensor:
    """Per-head weights w_j = h (1 - g_j) / (h - 1) of the mixture sum_i g_i f_i ([b, h])."""
    h = g.shape[-1]
    return (1.0 - g) * (h / (h - 1))


class MaeGate(nn.Module):
    """One layer's MAE gate (Peng et al., ACL 2020): g = softmax(W_2 relu(W_1 pool(x) + b_1)
    + b_2) over the h experts, and the per-head weights w_j = h (1 - g_j) / (h - 1) it puts
    on the heads' outputs before W_O (F steps: one drawn expert's). Cost per layer
    O(b (n D + D hidden + hidden h)) for the gate, O(b n h dv) for the scaling. Deviation:
    W_2, b_2 start at zero (uniform g)."""

    def __init__(self, width: int, num_heads: int, cfg: MaeConfig) -> None:
        super().__init__()
        hidden = width if cfg.gate_hidden is None else cfg.gate_hidden
        self.hidden = nn.Linear(width, hidden) if hidden else None
        self.out = nn.Linear(hidden or width, num_heads)
        nn.init.zeros_(self.out.weight)  # g = 1/h at the start: the host model's function
        nn.init.zeros_(self.out.bias)
        self.num_heads, self.pool = num_heads, cfg.pool
        self.sample = False  # F steps of schedule "bcd": draw one expert per sequence
        self.mask_at = 1  # position of attention_mask among the attention module's arguments
        self._pending: torch.Tensor | None = None  # w [b, h] from the attention pre-hook
        self.last_weights: torch.Tensor | None = None  # the last forward's w [b, h], detached

    def responsibilities(self, x: torch.Tensor, key_mask: torch.Tensor | None
                         ) -> torch.Tensor:
        """g [b, h] from the layer input x [b, n, D] (key_mask [b, n] True = token)."""
        if self.pool == "cls":
            pooled = x[:, 0]  # [b, D]
        elif key_mask is None:
            pooled = x.mean(1)
        else:
            keep = key_mask.to(x.dtype).unsqueeze(-1)  # [b, n, 1]
            pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)  # [b, D]
        z = pooled if self.hidden is None else F.relu(self.hidden(pooled))
        return torch.softmax(self.out(z), dim=-1)  # [b, h]

    def head_weights(self, g: torch.Tensor) -> torch.Tensor:
        """w [b, h]: the mixture's, or (sampling, training) one drawn expert's per sequence."""
        if self.sample and self.training:
            drop = torch.multinomial(g.detach(), 1)  # [b, 1] expert i ~ g
            e = torch.zeros_like(g).scatter_(1, drop, 1.0)
            return head_weights_from_gate(e)
        return head_weights_from_gate(g)

    # Hooks (bound methods, so a deep copy of the model hooks its own copy of the gate):
    # the attention module's forward pre-hook computes w, W_O's pre-hook applies it.
    def attention_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["hidden_states"]  # [b, n, D]
        mask = (args[self.mask_at] if len(args) > self.mask_at
                else kwargs.get("attention_mask"))
        b, n = x.shape[:2]
        key_mask = key_mask_from_hf(mask, b, n) if mask is not None else None
        self._pending = self.head_weights(self.responsibilities(x, key_mask))

    def output_pre_hook(self, module: nn.Module, args: tuple) -> tuple:
        """W_O's input ctx [b, n, h*dv] -> each head's slice times its weight."""
        w, self._pending = self._pending, None
        if w is None:
            raise RuntimeError("MAE gate: W_O ran without its attention module's pre-hook")
        self.last_weights = w.detach()
        ctx = args[0]
        b, n, hd = ctx.shape
        heads = ctx.view(b, n, self.num_heads, hd // self.num_heads)  # [b, n, h, dv]
        return ((heads * w.to(ctx.dtype)[:, None, :, None]).view(b, n, hd), *args[1:])


def _argument_names(module: nn.Module) -> list[str]:
    return [p for p in inspect.signature(module.forward).parameters if p != "self"]


def install(model: nn.Module, cfg: MaeConfig) -> list[MaeGate]:
    """Add a gate to every self-attention layer of ``model`` (in place) with its two hooks,
    and record it for ``attnlab.load_pretrained``; returns the gates in layer order."""
    host = inspect_model(model)
    if host.num_heads < 2:
        raise ValueError("MAE needs at least 2 heads per layer (experts drop one head)")
    projections = output_projections(model, host)
    gates = []
    for attn, (_, w_o) in zip(host.attention, projections, strict=True):
        names = _argument_names(attn)
        if not names or names[0] != "hidden_states" or "attention_mask" not in names:
            raise UnsupportedModelError(
                f"MAE reads the layer input from {type(attn).__name__}.forward(hidden_states, "
                f"attention_mask, ...); this module takes ({', '.join(names)}). Use a "
                "BERT-layout model (BERT, RoBERTa, ELECTRA, ...).")
        if getattr(attn, GATE_ATTR, None) is not None:
            raise ValueError("this model already has MAE gates")
        gate = MaeGate(w_o.out_features, host.num_heads, cfg)
        gate.to(device=w_o.weight.device, dtype=w_o.weight.dtype)
        gate.mask_at = names.index("attention_mask")
        setattr(attn, GATE_ATTR, gate)
        attn.register_forward_pre_hook(gate.attention_pre_hook, with_kwargs=True)
        w_o.register_forward_pre_hook(gate.output_pre_hook)
        gates.append(gate)
    mark_rebuild(model, MaeConfig.name, cfg.to_dict())
    return gates


def _rebuild(model: nn.Module, payload: Any) -> None:
    cfg = TUNERS.config(payload)
    if not isinstance(cfg, MaeConfig):
        raise ValueError(f"rebuild.json's 'mae' entry holds a {cfg.name} config")
    install(model, cfg)


register_rebuilder(MaeConfig.name, _rebuild)


def gates_of(model: nn.Module) -> list[MaeGate]:
    """The MAE gates of a model, in layer order (empty: not an MAE model)."""
    return [m for m in unwrap_peft(model).modules() if isinstance(m, MaeGate)]


def set_phase(model: nn.Module, phase: Phase, expert_step: str = "sample") -> None:
    """Which parameters train next: "joint" (all, on the mixture), "gate" (the gates only,
    on the mixture) or "experts" (all but the gates; one sampled expert per sequence when
    ``expert_step="sample"``, else the mixture with the gates training too)."""
    gates = gates_of(model)
    if not gates:
        raise ValueError("this model has no MAE gates; apply the mae tuner first")
    gate_ids = {id(p) for g in gates for p in g.parameters()}
    sample = phase == "experts" and expert_step == "sample"
    for p in model.parameters():
        is_gate = id(p) in gate_ids
        p.requires_grad_(phase == "joint" or (is_gate if phase == "gate" else
                                              (not is_gate or not sample)))
    for g in gates:
        g.sample = sample


def phase_of_step(cfg: MaeConfig, step: int) -> Phase:
    """G steps first, then F steps, repeating (schedule "bcd"); always "joint" otherwise."""
    if cfg.schedule == "joint":
        return "joint"
    return "gate" if step % (cfg.g_steps + cfg.f_steps) < cfg.g_steps else "experts"


_CFG_ATTR = "_attnlab_mae"


@register_tuner(MaeConfig)
class MaeTuner:
    """Gates added, every parameter trains (in the schedule's phases); everything is saved."""

    def apply(self, model: nn.Module, cfg: MaeConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        install(model, cfg)
        object.__setattr__(model, _CFG_ATTR, cfg)  # read by before_step
        set_phase(model, "joint")
        return finish_tuning(model, record)

    def before_step(self, model: nn.Module, step: int) -> None:
        cfg = getattr(model, _CFG_ATTR, None)
        if not isinstance(cfg, MaeConfig):
            raise ValueError("this model was not tuned with mae; apply it first")
        set_phase(model, phase_of_step(cfg, step), cfg.expert_step)

    def trainable_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """Every parameter: each trains in some phase (whatever the current phase is)."""
        return list(model.named_parameters())

    def state_dict_to_save(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}

    def load_tuned(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        load_exact(model, state, (n for n, _ in model.named_parameters()))

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        return None

    def param_options(self, model: nn.Module) -> dict[int, dict]:
        return {}

    def finalize_stage(self, cfg: TunerConfig) -> FinalizeStage | None:
        return None

    def finalize(self, model: nn.Module) -> None:
        return None
