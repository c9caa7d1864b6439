"""The "attnlab" attention function for transformers' AttentionInterface.

transformers (>= 5) lets a model's attention modules call any function registered in
``AttentionInterface``; they pass ``query, key, value`` as [b, h, n, d] and expect
``(out [b, n, h, d], weights [b, h, n, m] or None)``. :func:`register_backend` registers
:func:`attnlab_attention` under "attnlab", together with transformers' ``sdpa_mask`` as its
mask builder (without one the padding mask arrives as ``None`` and padded batches silently
differ).

:func:`attnlab_attention` runs the mechanisms that surgery installed on the attention module
as ``module.attnlab`` (an :class:`AttnlabLayer`): each group of heads goes through its own
mechanism, and the outputs are put back in head order. A module without one runs plain
``softmax`` on all heads, so a model switched to "attnlab" without a plan computes the same
function as with "sdpa".
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..core import AttnContext, HeadDims, Mechanism, build_mechanism
from ..core.protocol import TASK_ID
from .fused import LOCAL_PATTERN, local_pattern, mask_allows, run_mechanism
from .prefix import extend_kv

BACKEND = "attnlab"  # the name registered in AttentionInterface / AttentionMaskInterface
LAYER_ATTR = "attnlab"  # attention-module attribute holding the installed AttnlabLayer
STATE_ATTR = "_attnlab_forward_state"  # base-model attribute holding the ForwardState
REPLAY_KWARG = "attnlab_replay"  # keyword carrying a checkpointed forward's Replay downwards
HEAD_MASK_ATTR = "_attnlab_head_mask"  # attention-module attribute: head mask xi (hf.headmask)


class Replay:
    """The cross-layer state each layer found during one gradient-checkpointed forward.

    Gradient checkpointing recomputes a layer during backward, after the forward finished
    (its state is gone) and in reverse layer order. So that a cross-layer mechanism
    (RealFormer, Luna, Predictive Attention, LazyFormer) recomputes exactly what it computed,
    each layer's entry ``seen[layer_idx]`` is a shallow copy of ``ctx.state`` as that layer
    found it, and the recomputation runs on a copy of that copy. The Replay object reaches
    the attention calls as the keyword ``attnlab_replay`` that the base model's forward
    pre-hook adds and transformers passes down to every attention call; the checkpointed
    layer keeps its keywords for the recomputation, so a recomputation finds the Replay of
    its own forward even when several forwards precede one backward. ``done`` is set when
    the forward has returned: from then on a call is a recomputation. Memory: the copies
    hold what the mechanisms passed up (e.g. RealFormer's scores [b,h,n,m] per layer), the
    inputs that a recomputation needs, until the backward frees the graph.
    """

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, Any]] = {}  # layer_idx -> ctx.state as found
        self.done = False


class ForwardState:
    """Per-forward scratch shared by all attention layers of one model.

    ``state`` is the dict every mechanism sees as ``ctx.state`` (RealFormer passes scores
    from layer l to l+1 through it); ``aux_loss`` sums the mechanisms' auxiliary losses.
    Both are reset by a forward pre-hook on the model's base (see :func:`install_reset_hook`),
    so nothing leaks from one forward into the next. ``replay`` is the forward's
    :class:`Replay` while a gradient-checkpointed training forward runs (else None).
    """

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self.aux_loss: torch.Tensor | None = None
        self.replay: Replay | None = None
        self.task_ids: torch.Tensor | None = None  # set_task_id: [] or [b] long; kept by reset

    def reset(self) -> None:
        self.state = {}
        self.aux_loss = None
        self.replay = None

    def __deepcopy__(self, memo: dict) -> ForwardState:
        # Per-forward scratch is never worth copying (and holds non-leaf tensors that
        # deepcopy refuses): a copied model starts with a fresh one, and keeps its task ids.
        new = ForwardState()
        new.task_ids = copy.deepcopy(self.task_ids, memo)
        return new

    def __getstate__(self) -> dict:
        return {"task_ids": self.task_ids}  # pickled (torch.save of a model): as deepcopy

    def __setstate__(self, state: dict) -> None:
        self.reset()
        self.task_ids = state.get("task_ids")

    def add_aux(self, loss: torch.Tensor) -> None:
        self.aux_loss = loss if self.aux_loss is None else self.aux_loss + loss


@functools.cache
def _takes_var_kwargs(cls: type[nn.Module]) -> bool:
    params = inspect.signature(cls.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _checkpointing(module: nn.Module) -> bool:
    """A training forward with gradients through a model whose layers are checkpointed."""
    return (module.training and torch.is_grad_enabled()
            and any(getattr(m, "gradient_checkpointing", False) is True
                    for m in module.modules()))


def _reset_forward_state(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
    """Forward pre-hook on the base model: a fresh per-forward state for every forward, and
    under gradient checkpointing a fresh :class:`Replay`, passed down as a keyword."""
    holder = getattr(module, STATE_ATTR, None)
    if holder is None:
        return None
    holder.reset()
    if not _checkpointing(module):
        return None
    holder.replay = Replay()
    # cast: mypy does not see a class object type[Module] as Hashable (the cache key)
    if not _takes_var_kwargs(cast(type, type(module))):
        return None  # cannot pass it down; attnlab_attention refuses cross-layer state then
    return args, {**kwargs, REPLAY_KWARG: holder.replay}


def _drop_forward_scratch(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook on the base model: free the cross-layer scratch once the forward is done
    (``aux_loss`` stays readable until the next forward); mark its Replay done."""
    holder = getattr(module, STATE_ATTR, None)
    if holder is not None:
        # Emptied in place: every layer's AttnContext still points at this dict, and a
        # checkpointed closure holding a context would otherwise keep what the layers
        # passed up (and their graphs) alive through a cycle no collector frees.
        holder.state.clear()
        holder.state = {}
        if holder.replay is not None:
            holder.replay.done = True
            holder.replay = None


def install_reset_hook(base: nn.Module, holder: ForwardState) -> None:
    """Attach ``holder`` to ``base`` and register the reset/cleanup hooks once (idempotent).

    The hooks are module-level functions reading the holder from the module they run on, so
    a deep copy of the model resets its own (copied) holder, not the original's.
    """
    setattr(base, STATE_ATTR, holder)
    if not any(h is _reset_forward_state for h in base._forward_pre_hooks.values()):
        base.register_forward_pre_hook(_reset_forward_state, with_kwargs=True)
    if not any(h is _drop_forward_scratch for h in base._forward_hooks.values()):
        base.register_forward_hook(_drop_forward_scratch)


class AttnlabLayer(nn.Module):
    """The mechanisms installed in one attention layer, each on its group of heads.

    groups: one mechanism module per group, in ``nn.ModuleList`` ``mechanisms`` (so their
    parameters save, load and train with the host model); ``heads[i]`` are the head indices
    of group i. Head-scope groups receive ``q[:, heads]``; a group covering the whole layer
    receives q, k, v untouched (with ``kv_heads`` K/V heads when a module-scope mechanism
    shrank the projections). Outputs are concatenated and put back in head order.
    ``head_dims`` (dk, dv): a module-scope mechanism re-sized the Q/K/V projections
    (``head_size``); the host still splits them into heads of its own head size d (h*dk/d
    of them for q and k, h*dv/d for v), and q, k, v are regrouped here into h heads of dk,
    dk and dv before the mechanism runs.
    """

    inverse: torch.Tensor  # buffer registered in __init__

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        groups: Sequence[tuple[tuple[int, ...], nn.Module]],
        forward_state: ForwardState,
        kv_heads: int | None = None,
        head_dims: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        covered = sorted(h for heads, _ in groups for h in heads)
        if covered != list(range(num_heads)):
            raise ValueError(f"groups must cover heads 0..{num_heads - 1} once, got {covered}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.kv_heads = kv_heads
        self.head_dims = head_dims
        self.heads = tuple(tuple(heads) for heads, _ in groups)
        self.mechanisms = nn.ModuleList(mech for _, mech in groups)
        self.forward_state = forward_state
        self.whole = len(groups) == 1  # one mechanism on all heads: no slicing, no reorder
        for i, heads in enumerate(self.heads):
            self.register_buffer(f"heads_{i}", torch.tensor(heads), persistent=False)
        order = torch.tensor([h for heads in self.heads for h in heads])
        self.register_buffer("inverse", torch.argsort(order), persistent=False)

    def _mechs(self) -> list[Mechanism]:
        """The mechanism modules of ``mechanisms``, in group order."""
        return cast("list[Mechanism]", list(self.mechanisms))  # built by build_mechanism

    def names(self) -> list[str]:
        return [m.cfg.name for m in self._mechs()]

    def head_table(self) -> list[str]:
        """Mechanism spec of every head, in head order."""
        out = [""] * self.num_heads
        for heads, mech in zip(self.heads, self._mechs(), strict=True):
            for h in heads:
                out[h] = mech.cfg.spec()
        return out

    def extra_repr(self) -> str:
        groups = ", ".join(f"{m.cfg.name}@{list(h)}" for h, m in zip(self.heads,
                                                                       self._mechs(),
                                                                       strict=True))
        return f"layer_idx={self.layer_idx}, groups=[{groups}]"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[str]]:
        """q [b,h,n,d], k/v [b,h|kv,m,d] -> (out [b,h,n,d], probs [b,h,n,m] or None,
        names of the mechanisms that gave no probabilities)."""
        if self.head_dims is not None:  # [b,h',n,g] -> [b,h,n,dk|dv] (h'*g = h*dk|h*dv)
            q, k, v = (_regroup_heads(x, self.num_heads) for x in (q, k, v))
        m = k.shape[2]
        outs, probs, missing = [], [], []
        for i, mech in enumerate(self._mechs()):
            max_len = mech.dims.max_len
            if mech.caps.needs_max_len and max_len is not None and m > max_len:
                raise ValueError(
                    f"layer {self.layer_idx} heads {list(self.heads[i])}: mechanism "
                    f"{mech.cfg.name!r} was built for at most {max_len} positions "
                    f"(HeadDims.max_len) but the input has {m}; truncate the input to "
                    f"{max_len} tokens or re-apply the plan with a larger max_len"
                )
            if not mech.caps.key_mask_ok and ctx.key_mask is not None:
                _warn_key_mask(mech.cfg.name, ctx.key_mask)
            if self.whole:
                res = run_mechanism(mech, q, k, v, ctx)
            else:
                idx = getattr(self, f"heads_{i}")
                res = run_mechanism(mech, q.index_select(1, idx), k.index_select(1, idx),
                                    v.index_select(1, idx), ctx)
            outs.append(res.out)  # [b,hg,n,d]
            if res.probs is None:
                missing.append(mech.cfg.name)
            else:
                probs.append(res.probs)
            if res.aux_loss is not None:
                self.forward_state.add_aux(res.aux_loss)
        if self.whole:
            out = outs[0]
            p = probs[0] if probs else None
        else:
            out = torch.cat(outs, dim=1).index_select(1, self.inverse)  # [b,h,n,d]
            p = None
            if probs and not missing:
                dtype = probs[0].dtype
                p = torch.cat([x.to(dtype) for x in probs], 1).index_select(1, self.inverse)
        return out, (p if ctx.need_weights and not missing else None), missing


def _regroup_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[b, h', n, g] -> [b, h, n, h'*g/h]: the host's split of a re-sized projection into
    heads of g features, regrouped into ``num_heads`` heads (head-major features)."""
    b, hp, n, _ = x.shape
    if hp == num_heads:
        return x
    return x.transpose(1, 2).reshape(b, n, num_heads, -1).transpose(1, 2)


@functools.cache
def _warn_key_mask_once(name: str) -> None:
    warnings.warn(
        f"mechanism {name!r} declares key_mask_ok=False: padded keys are not masked, so "
        "outputs of padded batches depend on the padding; use unpadded batches of equal "
        "length with it",
        stacklevel=4,
    )


def _warn_key_mask(name: str, key_mask: torch.Tensor) -> None:
    if not bool(key_mask.all()):
        _warn_key_mask_once(name)


# ------------------------------------------------------------------------------ capture sink


class AttentionRecorder:
    """Collects probabilities per attention module during :func:`recording`."""

    def __init__(self) -> None:
        self.probs: dict[int, torch.Tensor] = {}  # id(module) -> [b,h,n,m] float32 cpu
        self.missing: dict[int, list[str]] = {}  # id(module) -> mechanisms without probs

    def record(self, module: nn.Module, probs: torch.Tensor | None, missing: list[str]) -> None:
        if missing or probs is None:
            self.missing[id(module)] = missing or ["(unknown)"]
        else:
            self.probs[id(module)] = probs.detach().to(device="cpu", dtype=torch.float32)


_RECORDER: ContextVar[AttentionRecorder | None] = ContextVar("attnlab_recorder", default=None)


@contextmanager
def recording() -> Iterator[AttentionRecorder]:
    """While active, every "attnlab" attention call materialises and records probabilities."""
    rec = AttentionRecorder()
    token = _RECORDER.set(rec)
    try:
        yield rec
    finally:
        _RECORDER.reset(token)


# --------------------------------------------------------------------------- the function


def key_mask_from_hf(mask: torch.Tensor | None, b: int, m: int) -> torch.Tensor | None:
    """transformers' attention mask -> key mask [b, m] bool (True = keep).

    Accepts bool masks (True = attend), additive float masks (0 = attend; -inf, the
    dtype's minimum or the legacy -10000, anything at most ``fused.ADDITIVE_MASKED`` = not)
    and 0/1 integer masks, 2-D [b, m] or 4-D [b, 1|h, n, m]. A key is kept when any query
    may attend it; a causal pattern inside the mask is carried by ``ctx.causal``.
    """
    if mask is None:
        return None
    allowed = mask_allows(mask)
    if allowed.dim() == 4:
        allowed = allowed[..., -m:].flatten(1, 2).any(1)  # [b,m]
    elif allowed.dim() != 2:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} is neither [b, m] nor [b, 1, n, m]"
        )
    return allowed.expand(b, m)


@functools.lru_cache(maxsize=64)
def _plain_softmax(num_heads: int, head_dim: int) -> Mechanism:
    return build_mechanism("softmax", HeadDims(num_heads, head_dim))


def _expand_kv(k: torch.Tensor, v: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query hosts: repeat K/V heads to the query head count (as transformers does)."""
    hk = k.shape[1]
    if hk == h:
        return k, v
    if h % hk:
        raise ValueError(f"{h} query heads cannot share {hk} K/V heads evenly")
    return k.repeat_interleave(h // hk, dim=1), v.repeat_interleave(h // hk, dim=1)


def _layer_state(layer: AttnlabLayer, replay: Replay | None) -> dict[str, Any]:
    """The ``ctx.state`` a layer's call gets: the forward's dict, or under gradient
    checkpointing, in a recomputation, a copy of what the layer found in its forward."""
    if replay is None:
        return layer.forward_state.state
    if replay.done:
        return dict(replay.seen.get(layer.layer_idx, {}))
    replay.seen[layer.layer_idx] = dict(layer.forward_state.state)
    return layer.forward_state.state


def _check_replayable(layer: AttnlabLayer, replay: Replay | None, state: dict[str, Any]) -> None:
    """Under gradient checkpointing, refuse a layer that wrote cross-layer state which its
    recomputation cannot reproduce with gradients (see :class:`Replay`)."""
    holder = layer.forward_state
    if holder.replay is None or (replay is not None and replay.done):
        return
    before = holder.replay.seen.get(layer.layer_idx, {}) if replay is not None else {}
    if state.keys() == before.keys() and all(state[k] is before[k] for k in before):
        return  # this layer passed nothing up
    names = ", ".join(layer.names())
    if replay is None:
        raise ValueError(
            f"layer {layer.layer_idx} ({names}) passes state to the next layer, which this "
            "model cannot replay under gradient checkpointing (its forward does not pass "
            "keyword arguments down to attention); call model.gradient_checkpointing_disable()"
        )
    if not torch.is_grad_enabled():
        raise ValueError(
            f"layer {layer.layer_idx} ({names}) passes state to the next layer, which "
            "reentrant gradient checkpointing cuts from the gradient; enable it with "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': False}) (the default)"
        )


def attnlab_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AttentionInterface entry point. q [b,h,n,d], k/v [b,h|kv,m,d].

    Returns (out [b,n,h,d] contiguous, probs [b,h,n,m] or None). ``kwargs`` is the host's
    pass-through (``output_attentions``, ``is_causal``, ``position_ids``, ...); only
    ``output_attentions``, ``is_causal``, ``sliding_window`` and ``attnlab_replay`` (our own,
    under gradient checkpointing: :class:`Replay`) are read, the rest concern other
    backends. On a local layer (``sliding_window`` given, e.g. ModernBERT's) the 4-D mask
    is kept as ``ctx.extras[LOCAL_PATTERN]``: see :mod:`attnlab.hf.fused`.
    Probabilities are returned when ``output_attentions`` is set or :func:`recording` is
    active, and only when every mechanism of the layer produced them.
    """
    layer: AttnlabLayer | None = getattr(module, LAYER_ATTR, None)
    b, h, n, d = query.shape
    m = key.shape[2]
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", False))
    # a ContextVar read is a graph break under torch.compile (one per attention call):
    # capture_attention records in eager runs only
    recorder = None if torch.compiler.is_compiling() else _RECORDER.get()
    need = bool(kwargs.get("output_attentions")) or recorder is not None
    replay: Replay | None = kwargs.get(REPLAY_KWARG)
    if layer is None:
        layer_idx = getattr(module, "layer_idx", None) or 0
        state: dict[str, Any] = {}
    else:
        layer_idx, state = layer.layer_idx, _layer_state(layer, replay)
    key_mask = key_mask_from_hf(attention_mask, b, m)
    if layer is None or layer.kv_heads is None:
        key, value = _expand_kv(key, value, h)
    key, value, key_mask = extend_kv(module, key, value, key_mask)  # prefix tuning, if any
    pattern = local_pattern(attention_mask, kwargs.get("sliding_window"), key.shape[2])
    extras: dict[str, Any] = {} if pattern is None else {LOCAL_PATTERN: pattern}  # [b,1|h,n,m]
    if layer is not None and layer.forward_state.task_ids is not None:
        extras[TASK_ID] = layer.forward_state.task_ids  # [] or [b] long (set_task_id)
    ctx = AttnContext(
        key_mask=key_mask,
        causal=bool(is_causal),
        layer_idx=layer_idx,
        need_weights=need,
        state=state,
        dropout=float(dropout),
        scale=scaling,
        extras=extras,
    )
    if layer is None:
        res = run_mechanism(_plain_softmax(h, d), query, key, value, ctx)
        out, probs, missing = res.out, res.probs, ([] if res.probs is not None or not need
                                                   else ["softmax"])
    else:
        out, probs, missing = layer(query, key, value, ctx)
        _check_replayable(layer, replay, state)
    if recorder is not None:
        recorder.record(module, probs, missing)
    gate = getattr(module, HEAD_MASK_ATTR, None)
    if gate is not None:  # hf.headmask: each head's output times xi, before W_O
        out = out * _head_gate(gate, b, h).to(out.dtype)
    return out.transpose(1, 2).contiguous(), probs  # [b,n,h,d], [b,h,n,m] | None


def _head_gate(gate: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """A layer's head mask, [h] (one for the batch) or [b, h] (per example), as
    [1|b, h, 1, 1] to scale out [b, h, n, dv]."""
    if gate.shape not in ((h,), (b, h)):
        raise ValueError(f"head mask of shape {tuple(gate.shape)} for a layer of {h} heads "
                         f"and a batch of {b}; give [layers, {h}] or [{b}, layers, {h}]")
    return gate.reshape(-1, h, 1, 1)


def register_backend() -> str:
    """Register "attnlab" in AttentionInterface and AttentionMaskInterface (idempotent)."""
    AttentionInterface.register(BACKEND, attnlab_attention)
    AttentionMaskInterface.register(BACKEND, sdpa_mask)
    return BACKEND


def forward_state(model: nn.Module) -> ForwardState | None:
    """The ForwardState shared by ``model``'s installed layers (None if no plan applied)."""
    for mod in model.modules():
        if isinstance(mod, AttnlabLayer):
            return mod.forward_state
    return None


def set_task_id(model: nn.Module, task_ids: int | Sequence[int] | torch.Tensor | None) -> None:
    """Task id(s) for task-conditioned mechanisms (``camtl_prior``) in the next forwards.

    ``task_ids``: one int for the whole batch, or one per example ([b] ints); it stays in force
    for every following forward until set again (call it per batch in multi-task training);
    None clears it. Raises ValueError when no plan is applied or the ids are not integers.
    """
    holder = forward_state(model)
    if holder is None:
        raise ValueError("set_task_id: this model has no attnlab plan applied; call "
                         "attnlab.apply_plan(model, plan) first")
    if task_ids is None:
        holder.task_ids = None
        return
    ids = torch.as_tensor(task_ids)
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() > 1:
        raise ValueError(f"set_task_id takes an int or a 1-D list/tensor of ints (one per "
                         f"example), got {ids.dtype} of shape {tuple(ids.shape)}")
    holder.task_ids = ids.long()


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the mechanisms' auxiliary losses from the model's last forward (or None).

    Add it to the task loss when training with regularised mechanisms, e.g.
    ``loss = out.loss + attnlab.hf.aux_loss(model)`` (guard for None).
    """
    holder = forward_state(model)
    return None if holder is None else holder.aux_loss


register_backend()
