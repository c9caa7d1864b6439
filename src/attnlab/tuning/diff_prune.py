"""Diff pruning: a sparse, task-specific difference vector on top of frozen weights.

Guo, Rush, Kim, "Parameter-Efficient Transfer Learning with Diff Pruning", ACL 2021
(official code: github.com/dguo98/DiffPruning).

Every backbone parameter becomes theta = theta_0 + z * w with theta_0 frozen, w trained
(init 0) and z a hard-concrete gate per entry (Louizos, Welling, Kingma, "Learning Sparse
Neural Networks through L0 Regularization", ICLR 2018):

    u ~ U(0, 1),  s = sigmoid((log u - log(1 - u) + log_alpha) / beta)
    z = clamp(s * (zeta - gamma) + gamma, 0, 1)         (training)
    z = clamp(sigmoid(log_alpha) * (zeta - gamma) + gamma, 0, 1)   (eval, Louizos' estimate)
    E[||z||_0] = sum sigmoid(log_alpha - beta * log(-gamma / zeta))

``aux_loss`` returns lambda * E[||z||_0], which the runner adds to the task loss.
``finalize`` then does what the paper does at the end: magnitude-prune the diff
delta = z * w to the target sparsity (0.5% of the backbone, kept globally by |delta|) and
fix the binary mask. The runner (``attnlab run``) then trains w under that mask for
``mask_epochs`` more epochs (official scripts: 3) with a fresh optimizer (log_alpha no
longer trains, no L0 term) and keeps the best of those epochs on dev. Saving after
``finalize`` stores only the kept entries (flat indices + values). The task head trains
densely, as in the paper.
Cost: two extra tensors (w, log_alpha) the size of the backbone, plus one gate sample per
weight access.

How: ``torch.nn.utils.parametrize`` registers ``DiffParametrization`` on every backbone
parameter, so ``module.weight`` is recomputed from theta_0 (``parametrizations.<p>.original``)
on each access and the modelling code is untouched. A parameter that several modules share
(a plan's cross-layer ties: luna's P, ``linformer(share='layerwise')``'s E) gets one diff,
on its first use; its other uses read that one (``SharedDiff``), and so does a head
module that shares a backbone weight (a masked-LM decoder tied to the word embeddings).

Defaults are the hard-concrete constants of Louizos, Welling, Kingma, "Learning Sparse
Neural Networks through L0 Regularization", ICLR 2018 (beta 2/3, gamma -0.1, zeta 1.1). The
Diff-Prune scripts (dguo98/DiffPruning) instead use beta 1, gamma -1.5, zeta 1.5, log_alpha
init 5, lambda 1.25e-7, lr 1e-5 for 3 epochs with log_alpha in its own AdamW at lr 0.1
(``alpha_lr``, the default here too), then 3 epochs with the mask fixed at their script's
default lr 5e-5 (``mask_lr``): ``diff_prune(beta=1.0, gamma=-1.5, zeta=1.5, mask_lr=5e-5)``
with ``optim.lr=1e-5`` reproduces that recipe. Not implemented: the paper's structured
(group) penalty.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from .base import (
    FinalizeStage,
    OptimRecipe,
    TaskInfo,
    TunerConfig,
    backbone_of,
    finish_tuning,
    load_exact,
    register_tuner,
    requires_grad_parameters,
    set_trainable,
    start_tuning,
)


@dataclass(frozen=True, kw_only=True)
class DiffPruneConfig(TunerConfig):
    """theta = theta_0 + z * w with L0-relaxed gates, pruned to a target sparsity."""

    name = "diff_prune"
    recommended_optim = OptimRecipe(
        lr=1e-5, weight_decay=0.0, batch_size=8, max_length=128,
        source="dguo98/DiffPruning experiments/example_sst2.sh (then 3 fixed-mask epochs)",
    )
    target_sparsity: float = 0.005  # share of backbone entries kept by finalize (paper: 0.5%)
    l0_penalty: float = 1.25e-7  # lambda: weight of E[||z||_0] in the loss (official scripts)
    log_alpha_init: float = 5.0  # log_alpha at start (official alpha_init; gates open)
    beta: float = 2.0 / 3.0  # beta: hard-concrete temperature
    gamma: float = -0.1  # gamma: lower end of the stretched interval (< 0)
    zeta: float = 1.1  # zeta: upper end of the stretched interval (> 1)
    mask_epochs: float = 3.0  # epochs trained after pruning with the mask fixed (official: 3)
    alpha_lr: float | None = 0.1  # log_alpha's own AdamW lr (official: 0.1; None: optim.lr)
    mask_lr: float | None = None  # lr of the fixed-mask epochs (None: optim.lr; official: 5e-5)

    def __post_init__(self) -> None:
        if not 0.0 < self.target_sparsity <= 1.0:
            raise ValueError("target_sparsity must be in (0, 1]")
        if self.beta <= 0:
            raise ValueError("beta must be > 0")
        if self.alpha_lr is not None and self.alpha_lr <= 0:
            raise ValueError("alpha_lr must be > 0 (or None: log_alpha at optim.lr)")
        if self.mask_lr is not None and self.mask_lr <= 0:
            raise ValueError("mask_lr must be > 0 (or None: the fixed-mask epochs at optim.lr)")
        if self.mask_epochs < 0:
            raise ValueError("mask_epochs must be >= 0 (0: prune and stop, no masked epochs)")
        if not (self.gamma < 0.0 and self.zeta > 1.0):
            raise ValueError("need gamma < 0 < 1 < zeta for the stretched gate")


class _NoisyDiff(torch.autograd.Function):
    """theta_0 + clamp(sigmoid((noise + log_alpha) / beta) * (zeta - gamma) + gamma, 0, 1) * w
    in a few fused passes, with the gradient written out (w, log_alpha; theta_0 is frozen).

    The training-time gate touches every backbone entry twice per step; written as separate
    autograd ops it took about two thirds of a CPU step (profiled); fused, 1.8x faster
    (``python -m attnlab.bench.train_costs``, docs/benchmarks.md). ``reference_noisy_diff``
    is the plain autograd form it is tested against (forward and gradients, fp32 1e-6)."""

    @staticmethod
    def forward(ctx, theta0, w, log_alpha, noise, beta: float, gamma: float, zeta: float):
        # noise: logistic noise logit(u), u ~ U(eps, 1 - eps); a fresh tensor we may reuse
        s = noise.add_(log_alpha).div_(beta).sigmoid_()  # [shape of theta0]
        stretched = s.mul(zeta - gamma).add_(gamma)
        z = stretched.clamp(0.0, 1.0)
        cut = stretched != z  # torch.clamp passes the gradient where lo <= x <= hi
        ctx.save_for_backward(w, s, z, cut)
        ctx.scale = (zeta - gamma) / beta
        return torch.addcmul(theta0, z, w)

    @staticmethod
    def backward(ctx, grad):
        w, s, z, cut = ctx.saved_tensors
        grad_w = grad * z if ctx.needs_input_grad[1] else None
        grad_la = None
        if ctx.needs_input_grad[2]:  # d z / d log_alpha = scale * s (1 - s) where not cut
            grad_la = torch.ops.aten.sigmoid_backward(grad * w, s)
            grad_la.mul_(ctx.scale).masked_fill_(cut, 0.0)
        grad_theta0 = grad if ctx.needs_input_grad[0] else None
        return grad_theta0, grad_w, grad_la, None, None, None, None


def noisy_diff(theta0, w, log_alpha, noise, beta, gamma, zeta):
    """theta0 + w * the hard-concrete gate sampled with ``noise`` (fused: ``_NoisyDiff``)."""
    return _NoisyDiff.apply(theta0, w, log_alpha, noise, beta, gamma, zeta)


def reference_noisy_diff(theta0, w, log_alpha, noise, beta, gamma, zeta):
    """The training-time gate as plain autograd ops (the reference for ``_NoisyDiff``)."""
    s = torch.sigmoid((noise + log_alpha) / beta)
    return theta0 + (s * (zeta - gamma) + gamma).clamp(0.0, 1.0) * w


def logistic_noise(like: torch.Tensor) -> torch.Tensor:
    """log u - log(1 - u) with u ~ U(1e-6, 1 - 1e-6), shaped like ``like``."""
    return torch.rand_like(like).clamp_(1e-6, 1.0 - 1e-6).logit_()


class DiffParametrization(nn.Module):
    """theta_0 -> theta_0 + z * w for one parameter tensor (shape of theta_0)."""

    def __init__(self, like: torch.Tensor, cfg: DiffPruneConfig) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros_like(like))
        self.log_alpha = nn.Parameter(torch.full_like(like, cfg.log_alpha_init))
        self.cfg = cfg
        self.beta, self.gamma, self.zeta = cfg.beta, cfg.gamma, cfg.zeta
        self.fixed = False  # True after finalize: z = mask
        self.register_buffer("mask", None)  # bool, shape of w, once fixed

    def gate(self) -> torch.Tensor:
        """The deterministic gate: the fixed mask, or Louizos et al.'s test-time estimate
        clamp(sigmoid(log_alpha) (zeta - gamma) + gamma, 0, 1) (no temperature).
        Training samples a noisy gate inside ``_NoisyDiff`` instead."""
        if self.fixed:
            return self.mask.to(self.w.dtype)
        s = torch.sigmoid(self.log_alpha)
        return (s * (self.zeta - self.gamma) + self.gamma).clamp(0.0, 1.0)

    def forward(self, theta0: torch.Tensor) -> torch.Tensor:
        if self.training and not self.fixed:
            noise = logistic_noise(self.log_alpha)
            return noisy_diff(theta0, self.w, self.log_alpha, noise, self.beta,
                                    self.gamma, self.zeta)
        return theta0 + self.gate() * self.w

    def expected_l0(self) -> torch.Tensor:
        shift = self.beta * math.log(-self.gamma / self.zeta)
        return torch.sigmoid(self.log_alpha - shift).sum()

    def deterministic_diff(self) -> torch.Tensor:
        return (self.gate() * self.w).detach()

    def fix(self, mask: torch.Tensor, values: torch.Tensor) -> None:
        """Freeze the gate to ``mask`` (bool, shape of w) and set w to ``values``."""
        # own storage: a view into the global choice would make every mask one shared tensor
        self.mask = mask.to(device=self.w.device, dtype=torch.bool).clone()
        with torch.no_grad():
            self.w.copy_(values * mask)
        self.fixed = True
        self.log_alpha.requires_grad_(False)


class SharedDiff(nn.Module):
    """Another use of a weight that several modules share (tied across layers): it reads
    the first use's theta_0 + z * w, so one diff and one gate serve every use and the
    gradient of each use reaches them (in training each use draws its own gate sample, as
    every access of a diffed weight does). Holds no parameters of its own."""

    def __init__(self, owner: nn.Module, name: str) -> None:
        super().__init__()
        self._owner = [owner]  # in a list: not a submodule (the owner sits elsewhere)
        self.name = name

    def forward(self, theta0: torch.Tensor) -> torch.Tensor:
        return getattr(self._owner[0], self.name)


def diff_modules(model: nn.Module) -> dict[str, DiffParametrization]:
    """Logical parameter name (e.g. ``bert.encoder.layer.0.output.dense.weight``) -> gate."""
    out = {}
    for mod_name, mod in model.named_modules():
        plist = getattr(mod, "parametrizations", None)
        if not isinstance(plist, nn.ModuleDict):
            continue
        for pname, chain in plist.items():
            assert isinstance(chain, nn.ModuleList)  # torch's ParametrizationList
            for p in chain:
                if isinstance(p, DiffParametrization):
                    out[f"{mod_name}.{pname}" if mod_name else pname] = p
    return out


@register_tuner(DiffPruneConfig)
class DiffPruneTuner:
    """Parametrises every backbone parameter; trains w, log_alpha and the head."""


    def apply(self, model: nn.Module, cfg: DiffPruneConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        record = start_tuning(model, cfg)
        backbone = backbone_of(model)
        owners: dict[int, tuple[nn.Module, str]] = {}  # id(parameter) -> its first use
        targets, shared = [], []
        for mod in backbone.modules():
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) in owners:  # tied (luna's P, linformer(share='layerwise')'s E)
                    shared.append((mod, pname, owners[id(p)]))
                else:
                    owners[id(p)] = (mod, pname)
                    targets.append((mod, pname, p))
        inside = {id(m) for m in backbone.modules()}
        for mod in model.modules():  # a head's use of a backbone weight (an MLM decoder
            if id(mod) in inside:  # tied to the word embeddings) reads the diffed weight
                continue
            shared += [(mod, pname, owners[id(p)]) for pname, p in mod._parameters.items()
                       if p is not None and id(p) in owners]
        for mod, pname, p in targets:
            parametrize.register_parametrization(mod, pname, DiffParametrization(p, cfg))
        for mod, pname, (owner, oname) in shared:
            parametrize.register_parametrization(mod, pname, SharedDiff(owner, oname))
        keep_ids = {id(q) for g in diff_modules(model).values() for q in (g.w, g.log_alpha)}
        set_trainable(model, [n for n, q in model.named_parameters() if id(q) in keep_ids])
        return finish_tuning(model, record)

    def trainable_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return requires_grad_parameters(model)

    def finalize_stage(self, cfg: DiffPruneConfig) -> FinalizeStage:
        """Prune after training, then ``mask_epochs`` epochs with the mask fixed."""
        return FinalizeStage(epochs=cfg.mask_epochs, lr=cfg.mask_lr)

    def param_options(self, model: nn.Module) -> dict[int, dict]:
        """log_alpha trains at its own lr (``alpha_lr``, no weight decay), as the official
        scripts' separate ``AdamW(alpha_params, lr=0.1)`` does; at the diff's lr (1e-5)
        Adam moves log_alpha by about 1e-5 per step and the L0 term cannot close a gate."""
        gates = [g for g in diff_modules(model).values() if not g.fixed]
        if not gates or gates[0].cfg.alpha_lr is None:
            return {}
        return {id(g.log_alpha): {"lr": g.cfg.alpha_lr, "weight_decay": 0.0} for g in gates}

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        gates = [g for g in diff_modules(model).values() if not g.fixed]
        if not gates:
            return None
        return gates[0].cfg.l0_penalty * torch.stack([g.expected_l0() for g in gates]).sum()

    def before_step(self, model: nn.Module, step: int) -> None:
        return None  # the same parameters train in every step

    def finalize(self, model: nn.Module) -> None:
        """Keep the top ``target_sparsity`` share of |z * w| globally; fix that mask."""
        gates = diff_modules(model)
        if not gates:
            raise ValueError("this model has no diff-pruning gates; apply diff_prune first")
        cfg = next(iter(gates.values())).cfg
        diffs = {name: g.deterministic_diff() for name, g in gates.items()}
        flat = torch.cat([d.abs().flatten() for d in diffs.values()])
        keep = max(1, math.ceil(cfg.target_sparsity * flat.numel()))
        chosen = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        chosen[torch.topk(flat, keep, sorted=False).indices] = True
        start = 0
        for name, g in gates.items():
            n = diffs[name].numel()
            g.fix(chosen[start:start + n].view_as(diffs[name]), diffs[name])
            start += n

    def effective_without_head(self, model: nn.Module) -> int | None:
        """Kept diff entries after ``finalize`` (None before: every entry may change)."""
        gates = list(diff_modules(model).values())
        if not gates or not all(g.fixed for g in gates):
            return None
        return int(sum(int(g.mask.sum()) for g in gates))

    def state_dict_to_save(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Before finalize: dense ``diff.<p>.w`` and ``.log_alpha``; after: ``.indices`` and
        ``.values`` of the kept entries. Plus the head's weights under their own names."""
        gates = diff_modules(model)
        gate_ids = {id(q) for g in gates.values() for q in g.parameters()}
        state = {n: p.detach().clone().contiguous() for n, p in requires_grad_parameters(model)
                 if id(p) not in gate_ids}
        for name, g in gates.items():
            if g.fixed:
                idx = g.mask.flatten().nonzero().squeeze(1)
                state[f"diff.{name}.indices"] = idx
                state[f"diff.{name}.values"] = g.w.detach().flatten()[idx].clone()
            else:
                state[f"diff.{name}.w"] = g.w.detach().clone()
                state[f"diff.{name}.log_alpha"] = g.log_alpha.detach().clone()
        return state

    def load_tuned(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        gates = diff_modules(model)
        rest = {k: v for k, v in state.items() if not k.startswith("diff.")}
        gate_ids = {id(q) for g in gates.values() for q in g.parameters()}
        load_exact(model, rest, (n for n, p in requires_grad_parameters(model)
                                 if id(p) not in gate_ids))
        for name, g in gates.items():
            key = f"diff.{name}"
            if f"{key}.indices" in state:
                idx = state[f"{key}.indices"].to(g.w.device)
                mask = torch.zeros(g.w.numel(), dtype=torch.bool, device=g.w.device)
                mask[idx] = True
                values = torch.zeros(g.w.numel(), dtype=g.w.dtype, device=g.w.device)
                values[idx] = state[f"{key}.values"].to(g.w)
                g.fix(mask.view_as(g.w), values.view_as(g.w))
            elif f"{key}.w" in state and f"{key}.log_alpha" in state:
                with torch.no_grad():
                    g.w.copy_(state[f"{key}.w"])
                    g.log_alpha.copy_(state[f"{key}.log_alpha"])
            else:
                raise KeyError(f"tuned state has no diff for {name!r}; apply diff_prune with "
                               "the same config to the same architecture before loading")
        extra = {k.rsplit(".", 1)[0][len("diff."):] for k in state if k.startswith("diff.")}
        if extra - set(gates):
            raise KeyError(f"tuned state has diffs for unknown parameters "
                           f"{sorted(extra - set(gates))[:5]}")
