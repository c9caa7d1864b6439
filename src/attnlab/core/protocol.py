"""The one attention protocol every mechanism follows.

A mechanism is an ``nn.Module`` built as ``Cls(cfg, dims)`` and called as
``mech(q, k, v, ctx) -> AttnOutput``.

Shape glossary (used in comments across the package):
    b batch, h heads, n query length, m key length, d head dim, dv value head dim, w window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

import torch

from .spec import config_dict, config_spec

Scope = Literal["head", "layer", "module"]

# AttnContext.extras key: the batch's task id(s), an int or an int tensor [b] (task-conditioned
# mechanisms such as camtl_prior; the Hugging Face backend fills it, attnlab.hf.set_task_id).
TASK_ID = "task_id"


@dataclass(frozen=True, kw_only=True)
class MechanismConfig:
    """Base of every mechanism config: frozen, keyword-only, every field defaulted.

    Subclasses set the class-level ``name`` (the registry key, lower snake case) and add
    fields, each with a type, a default and a one-line comment giving the paper's symbol.
    """

    name: ClassVar[str] = ""

    def spec(self) -> str:
        """The spec string that rebuilds this config, e.g. ``band(window=64)``."""
        return config_spec(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form: ``{"name": ..., **fields}`` (tuples become lists)."""
        return config_dict(self)


@dataclass(frozen=True)
class HeadDims:
    """Dimensions of the host attention layer; always taken from the model, never the user.

    num_heads: h; head_dim: d; max_len: the host's maximum sequence length (None = unbounded).
    """

    num_heads: int
    head_dim: int
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.head_dim < 1:
            raise ValueError(f"HeadDims needs num_heads >= 1 and head_dim >= 1, got {self}")


@dataclass(frozen=True)
class Capabilities:
    """What a mechanism can do, declared before anything runs; surgery validates against it.

    scope: "head" may share a layer with other mechanisms; "layer" mixes across heads (must
      own every head of its layers); "module" also replaces projections (whole layers).
    causal_ok: supports ``ctx.causal``.  key_mask_ok: honours ``ctx.key_mask``.
    needs_max_len: has parameters sized by ``dims.max_len`` (e.g. Linformer's E, F).
    exact: equals dense softmax over ``bias(n, m)`` (tested against core.reference).
    complexity: time complexity in the shape glossary, e.g. "O(n*w)".
    kv_heads: for scope "module" mechanisms that shrink K/V projections, the number of
      K/V heads the host projections are reduced to (1 for multi-query attention).
    head_dims: for scope "module" mechanisms that re-size the heads, (dk, dv): the per-head
      sizes the host's Q/K projections and V projection (and the output projection's input)
      are re-sized to (``head_size``). A config-dependent value (``kv_heads`` of ``gqa``,
      ``head_dims``) is declared on the instance, which surgery reads after building it.
    keys_are_tokens: key j must be token j of the query sequence (n == m): position
      patterns, length-sized projections, jump graphs. Extra keys that are not tokens
      (prefix tuning's virtual keys) would silently shift the pattern, so tuners that add
      them refuse such plans.
    shared_qk: the keys are the (normalised) queries, the host's k is not read (Reformer's
      LSH attention); its K projection then gets no gradient from these heads.
    task_conditioned: reads task ids from ``ctx.extras[TASK_ID]`` (``camtl_prior``). Such a
      config has a field ``tasks`` (the number of task ids, 0..tasks-1) and a field ``task``
      (a fixed id, or None to take the batch's); the runner fills the ids from the run
      config's ``task.task_id`` (``attnlab.hf.set_task_id``) and refuses a plan that leaves
      one without an id before anything runs.
    reads_qk: False when neither q nor k is read (the weights depend on positions only, as in
      hard-coded Gaussian attention); the host's Q and K projections then get no gradient
      from these heads.
    reads_k: False when q is read but k is not (the dense Synthesizer alone); its K
      projection then gets no gradient from these heads. :meth:`reads` combines the three.
      Config-dependent values are declared on the instance, as ``kv_heads``.
    """

    family: str
    paper: str
    scope: Scope = "head"
    causal_ok: bool = True
    key_mask_ok: bool = True
    needs_max_len: bool = False
    exact: bool = False
    complexity: str = "O(n*m)"
    kv_heads: int | None = None
    keys_are_tokens: bool = False
    shared_qk: bool = False
    head_dims: tuple[int, int] | None = None
    reads_qk: bool = True
    reads_k: bool = True
    task_conditioned: bool = False

    def reads(self) -> tuple[bool, bool]:
        """(q is read, k is read): what gives the host's Q and K projections a gradient."""
        return self.reads_qk, self.reads_qk and self.reads_k and not self.shared_qk


@dataclass
class AttnContext:
    """Per-call context.

    key_mask: [b, m] bool, True = keep (None = no padding).
    causal: additionally require key j <= query i.
    layer_idx: 0-based layer index (seeds per-layer randomness; cross-layer state key).
    need_weights: return probabilities [b, h, n, m] in ``AttnOutput.probs``.
    state: per-forward dict shared by all layers (RealFormer passes scores up the stack).
    dropout: attention-probability dropout rate (applied only in training mode).
    scale: score scale; None means 1/sqrt(d).
    extras: further per-call inputs by key (``TASK_ID``: task ids; the backend's local pattern).
    """

    key_mask: torch.Tensor | None = None
    causal: bool = False
    layer_idx: int = 0
    need_weights: bool = False
    state: dict[str, Any] | None = None
    dropout: float = 0.0
    scale: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else head_dim**-0.5


class AttnOutput(NamedTuple):
    """out [b, h, n, dv]; probs [b, h, n, m] or None; aux_loss scalar tensor or None."""

    out: torch.Tensor
    probs: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


@runtime_checkable
class Mechanism(Protocol):
    """Structural type of a mechanism (an nn.Module built as ``Cls(cfg, dims)``).

    Class-level declarations, read before anything is built:
    caps: what it can do (surgery validates plans against it).
    example: a small spec of it, e.g. ``"band(window=3)"``, whose pattern is genuinely
      sparse at the contract tests' lengths (n <= 64, h = 4, d = 8); the contract tests
      (tests/mechanisms/test_contract.py) build every registered mechanism from it, and fail
      for a mechanism without one. The bare name when the defaults already fit.

    Optional class-level hook, for parameters shared across layers:
    tie(instances: Sequence[nn.Module]) -> None, a classmethod. Surgery builds one instance
    per layer (and head group); right after building, ``apply_plan`` calls ``tie`` once per
    distinct config with every instance built from that config, in layer order, and the
    hook makes them share parameters by assigning one instance's ``nn.Parameter`` to the
    others (Linformer's ``share="layerwise"``). Shared parameters train once (their
    gradient sums every layer's), count once in ``SurgeryReport.params_added``, are
    written once by ``attnlab.save_pretrained`` and are tied again on reload (the reload
    re-applies the plan, which calls the hook).
    """

    caps: ClassVar[Capabilities]
    example: ClassVar[str]
    cfg: MechanismConfig
    dims: HeadDims

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext
    ) -> AttnOutput: ...


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ``ok``: the one-line checks of configs and inputs
    (``message`` names the problem and the fix)."""
    if not ok:
        raise ValueError(message)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: HeadDims | None = None,
              kv_heads_ok: tuple[int, ...] = ()) -> None:
    """Validate ranks and shapes of q [b,h,n,d], k [b,h',m,d], v [b,h',m,dv].

    ``kv_heads_ok`` lists extra K/V head counts accepted besides q's (1 for multi-query).
    Raises ValueError naming the offending tensor and the expected layout.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, heads, length, head_dim], got shape "
                f"{tuple(t.shape)}; reshape with .view(b, n, h, d).transpose(1, 2)"
            )
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or (k.shape[1] != h and k.shape[1] not in kv_heads_ok):
        raise ValueError(
            f"k/v have {k.shape[1]}/{v.shape[1]} heads but q has {h}"
            + (f" (accepted K/V head counts: {h}, {kv_heads_ok})" if kv_heads_ok else "")
        )
    if k.shape[-1] != d:
        raise ValueError(f"q and k head dims differ: {d} vs {k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v lengths differ: {k.shape[2]} vs {v.shape[2]}")
    if dims is not None and h != dims.num_heads:
        raise ValueError(
            f"q has {h} heads but the mechanism was built for {dims.num_heads} "
            f"(HeadDims.num_heads)"
        )
