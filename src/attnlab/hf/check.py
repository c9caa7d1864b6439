"""check_model_config: refuse, from the model's config alone, what ``attnlab run`` would refuse.

``check_model_config(model, plan)`` reads the model's config (``AutoConfig.from_pretrained``
for a folder or hub name, the embedded MiniLM for ``"default"``, ``encoder_config(SIZE)`` for
``"scratch:SIZE"``, or a config object as given), builds the architecture on the meta device
(no weights are read and no memory is allocated), and runs everything :func:`apply_plan`
checks before it changes a model: :func:`inspect_model` (can attnlab replace this model's
attention at all?), the plan's validation against the host (layer and head indices, scopes,
causality, maximum length) and the construction of every mechanism. ``attnlab validate`` and
``recipes.finetune.run_experiment`` both call it, so ``validate`` refuses first whatever
``run`` would refuse, with the same message.

The model is checked even when the plan is empty: a model in ``arch.UNSUPPORTED`` (BigBird,
Longformer, ...) or one whose attention attnlab cannot find is refused by both commands, since
neither a plan nor attention capture could be applied to it.

Errors, each with a one-line message that names the fix: :class:`UnsupportedModelError` for
the model (unreadable config, unknown or unsupported architecture);
:class:`~attnlab.hf.plan.PlanError` (or :class:`~attnlab.hf.surgery.SurgeryError`) for a
plan the model cannot take.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoModel

from ..models import model_config
from .arch import FAMILIES, UNSUPPORTED, UnsupportedModelError, inspect_model
from .plan import Plan
from .surgery import _build, _validate
from .unread import ROLES, unread_layers

_FIX = ("set model.name to 'default' (the embedded MiniLM), 'scratch:SIZE', or a local folder "
        "of a supported encoder ({families})")


def _fix() -> str:
    return _FIX.format(families=", ".join(sorted(FAMILIES)))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def load_model_config(model: Any) -> Any:
    """The ``PretrainedConfig`` of ``model``: a config object (returned as is), ``"default"``,
    ``"scratch:SIZE"``, or a ``from_pretrained`` folder / hub name (config only)."""
    if not isinstance(model, str):
        return model
    try:
        return model_config(model)  # the config attnlab.models.load_model would build
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise UnsupportedModelError(
            f"cannot read the config of model {model!r} ({_one_line(e)}); {_fix()}"
        ) from None


def _meta_model(config: Any, name: str) -> torch.nn.Module:
    """The bare architecture of ``config`` on the meta device (no weights, no memory)."""
    config = copy.deepcopy(config)  # from_config sets fields (attention implementation)
    try:
        with torch.device("meta"):
            return AutoModel.from_config(config)
    except Exception as e:  # any failure to build means run would fail too
        raise UnsupportedModelError(
            f"transformers cannot build model {name!r} (model_type "
            f"{getattr(config, 'model_type', '?')!r}) from its config ({_one_line(e)}); "
            f"{_fix()}"
        ) from None


def check_model_config(model: Any, plan: Any = None, *, max_len: int | None = None
                       ) -> list[tuple[int, str, str]]:
    """Raise if ``attnlab run`` would refuse ``model`` with ``plan``; see the module doc.

    model: ``"default"``, ``"scratch:SIZE"``, a folder or hub name, or a ``PretrainedConfig``.
    plan: anything :meth:`Plan.parse` takes (None or empty: the model alone is checked).
    max_len: as :func:`apply_plan`'s (None: the model's ``max_position_embeddings``).
    Returns the projections the plan leaves unread (``SurgeryReport.unread``, ``hf.unread``)
    as (layer, role, module name), e.g. ``(0, "query", "query")`` or ``(1, "key", "k_lin")``.
    """
    config = load_model_config(model)
    name = model if isinstance(model, str) else type(config).__name__
    model_type = str(getattr(config, "model_type", "") or "")
    if model_type in UNSUPPORTED:
        raise UnsupportedModelError(
            f"model {name!r} (model_type {model_type!r}) {UNSUPPORTED[model_type]}; {_fix()}"
        )
    parsed = Plan.parse(plan) if plan else Plan()
    meta = _meta_model(config, name)
    try:
        host = inspect_model(meta)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"model {name!r}: {_one_line(e)}; {_fix()}") from None
    if max_len is None:
        max_len = host.max_len
    layers = _validate(parsed, host, max_len)
    built = _build(parsed, host, layers, max_len)
    return [(layer, role, host.proj[ROLES.index(role)])
            for layer, roles in sorted(unread_layers(built, host.fused).items()) for role in roles]
