"""Save and reload a model together with its attention plan.

``save_pretrained(model, path)`` writes the usual Hugging Face folder (``config.json``,
``model.safetensors``) plus ``plan.json`` (the applied plan) and ``surgery.json`` (the
SurgeryReport, including the ``max_len`` the mechanisms were built with). The extra files
are written atomically (:mod:`attnlab.io`).

``load_pretrained(path)`` rebuilds the architecture from ``config.json`` (no download),
re-applies the saved plan, then loads the safetensors weights *strictly*: mechanism
parameters and shrunk K/V projections included, nothing missing, nothing unexpected (tied
weights, saved once, are the only keys allowed to be absent: Hugging Face's tied embeddings
and mechanism parameters shared across layers, ``Mechanism.tie``, which the re-applied plan
ties again). It returns the model only; a tokenizer saved alongside loads with
``transformers.AutoTokenizer.from_pretrained(path)``.

Modules added outside ``hf/`` (MAE's gates, :mod:`attnlab.tuning.mae`) save and reload the
same way: the code that adds them records itself on the model (:func:`mark_rebuild`) and
registers how to add them again (:func:`register_rebuilder`); ``save_pretrained`` writes
those records to ``rebuild.json`` and ``load_pretrained`` replays them after the plan, before
the strict weight load.

Plain ``AutoModel.from_pretrained`` of such a folder does not know the plan: it loads the
unmodified softmax model, silently for a plan without parameters, with transformers' report
of unexpected keys for one with them, and fails with a size mismatch after a K/V shrink
(``mqa``, ``gqa``). :func:`load_pretrained` is the way to load it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from ..io import atomic_write
from .backend import LAYER_ATTR
from .plan import Plan, PlanError
from .surgery import SurgeryError, applied_report, apply_plan

PLAN_FILE = "plan.json"
SURGERY_FILE = "surgery.json"
REBUILD_FILE = "rebuild.json"
REBUILD_ATTR = "_attnlab_rebuild"  # model attribute: {name: JSON payload} (mark_rebuild)
_REBUILDERS: dict[str, Callable[[nn.Module, Any], None]] = {}


def register_rebuilder(name: str, rebuild: Callable[[nn.Module, Any], None]) -> None:
    """Let :func:`load_pretrained` add again what ``name`` added to a model: it calls
    ``rebuild(model, payload)`` with the payload given to :func:`mark_rebuild`."""
    _REBUILDERS[name] = rebuild


def mark_rebuild(model: nn.Module, name: str, payload: Any) -> None:
    """Record on ``model`` that ``name`` added modules to it; ``payload`` (JSON) is what the
    registered rebuilder needs to add them again. The record names the rebuilder's module,
    which :func:`load_pretrained` imports when nothing has yet."""
    if name not in _REBUILDERS:
        raise ValueError(f"mark_rebuild: no rebuilder registered as {name!r}; call "
                         "register_rebuilder first")
    records = dict(getattr(model, REBUILD_ATTR, None) or {})
    records[name] = {"module": _REBUILDERS[name].__module__, "payload": payload}
    setattr(model, REBUILD_ATTR, records)


def save_pretrained(model: nn.Module, path: str | os.PathLike, tokenizer: Any = None) -> Path:
    """``model.save_pretrained(path)`` + ``plan.json`` + ``surgery.json`` (+ the tokenizer).

    A model without an applied plan is saved with an empty plan (all softmax).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # HF method, nn.Module-typed model; state_dict=None is its default (model.state_dict())
    model.save_pretrained(out, state_dict=_state_without_tied_copies(model))  # type: ignore[operator]
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    report = applied_report(model)
    plan = report.plan if report is not None else Plan()
    atomic_write(out / PLAN_FILE, plan.to_json())
    surgery: dict[str, Any] = report.to_dict() if report is not None else {"max_len": None}
    atomic_write(out / SURGERY_FILE, json.dumps(surgery, indent=2))
    records = getattr(model, REBUILD_ATTR, None)
    if records:
        atomic_write(out / REBUILD_FILE, json.dumps(records, indent=2))
    else:
        (out / REBUILD_FILE).unlink(missing_ok=True)  # left by an earlier save to this folder
    return out


def _state_without_tied_copies(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The state dict without the second and later names of each mechanism parameter that
    several layers share (``Mechanism.tie``, e.g. Linformer's layerwise E); None when none
    is shared. safetensors stores no aliased tensors, and Hugging Face's save refuses shared
    tensors that are not its own tied embeddings. The reload re-applies the plan, which ties
    them again, and then fills the shared parameter from its first name."""
    first: dict[int, str] = {}
    copies = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if f".{LAYER_ATTR}." not in f".{name}":
            continue
        if id(p) in first:
            copies.append(name)
        else:
            first[id(p)] = name
    if not copies:
        return None
    state = model.state_dict()
    for name in copies:
        del state[name]
    return state


def _auto_class(config, auto_class):
    if auto_class is not None:
        return auto_class
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    single = folder / "model.safetensors"
    if single.exists():
        return load_file(single)
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        raise FileNotFoundError(
            f"no model.safetensors (or sharded index) in {folder}; save with "
            "attnlab.save_pretrained(model, path)"
        )
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(folder / shard))
    return state


def _tied_aliases(model: nn.Module) -> dict[str, set[str]]:
    """Parameter name -> every name sharing its tensor (tied embeddings are saved once)."""
    by_tensor: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), set()).add(name)
    return {n: names for names in by_tensor.values() for n in names}


def _rebuild(model: nn.Module, folder: Path) -> None:
    """Replay ``rebuild.json``: add again the modules recorded with :func:`mark_rebuild`."""
    file = folder / REBUILD_FILE
    if not file.exists():
        return
    for name, record in json.loads(file.read_text()).items():
        if name not in _REBUILDERS:  # the module that registers it, named in the record
            with contextlib.suppress(ImportError):
                importlib.import_module(record["module"])
        if name not in _REBUILDERS:
            raise SurgeryError(
                f"{folder} holds modules added by {name!r}, and importing "
                f"{record['module']!r} did not register a way to add them again; install the "
                "attnlab version that saved the folder")
        _REBUILDERS[name](model, record["payload"])


def _unregistered(text: str) -> list[str]:
    """The mechanism names of a saved plan's JSON that this process has not registered
    (any rule form ``Plan.parse`` takes; [] where the JSON does not say)."""
    from ..core import list_mechanisms
    from ..core.spec import RegistryError, parse_spec

    try:
        data = json.loads(text)
    except ValueError:
        return []
    rules = data.get("plan", [data]) if isinstance(data, dict) else data
    names = set()
    for rule in rules if isinstance(rules, list) else []:
        spec = rule.get("mechanism") if isinstance(rule, dict) else rule
        if isinstance(spec, dict):
            spec = spec.get("name")
        elif isinstance(spec, str) and isinstance(rule, str):
            spec = spec.rsplit(":", 1)[-1]  # LAYERS:HEADS:SPEC
        if isinstance(spec, str):
            try:
                names.add(parse_spec(spec)[0])
            except RegistryError:
                continue
    known = set(list_mechanisms())
    return sorted(n for n in names if n not in known)


def _read_plan(plan_file: Path) -> Plan:
    """The saved plan. A name this process has not registered may be a user's own
    mechanism whose module was not imported: the error says so beside its usual hint."""
    text = plan_file.read_text()
    try:
        return Plan.from_json(text)
    except PlanError as err:
        missing = _unregistered(text)
        if not missing:
            raise
        raise PlanError(
            f"{err} If {', '.join(map(repr, missing))} is a mechanism of your own, import the "
            "module that registers it (its @register_mechanism class) before "
            "load_pretrained.") from None


def load_pretrained(path: str | os.PathLike, auto_class: Any = None) -> nn.Module:
    """Rebuild the model saved by :func:`save_pretrained` with its plan and weights.

    auto_class: a transformers class (``AutoModelForSequenceClassification``,
    ``BertForMaskedLM``, ...) to build with; default: ``config.architectures[0]``.
    Returns the model in eval mode.
    """
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} has no config.json; is it a saved model folder?")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    cls = _auto_class(config, auto_class)
    model: nn.Module
    if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
        model = cls(config)
    else:  # an Auto class
        model = cls.from_config(config)
    plan_file, surgery_file = folder / PLAN_FILE, folder / SURGERY_FILE
    if not plan_file.exists():
        warnings.warn(
            f"{folder} has no {PLAN_FILE}: loading it with plain softmax attention. A model "
            "saved with Hugging Face's model.save_pretrained loses its plan; save with "
            "attnlab.save_pretrained(model, path) to keep it.", stacklevel=2)
    plan = _read_plan(plan_file) if plan_file.exists() else Plan()
    max_len = None
    if surgery_file.exists():
        max_len = json.loads(surgery_file.read_text()).get("max_len")
    if plan.rules:  # nothing to convert: the saved weights replace the projections
        apply_plan(model, plan, max_len=max_len, convert_projections=False)
    _rebuild(model, folder)

    state = _read_state_dict(folder)
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(floats) == 1:
        model.to(floats.pop())
    result = model.load_state_dict(state, strict=False)
    aliases = _tied_aliases(model)
    missing = [k for k in result.missing_keys if not (aliases.get(k, {k}) - {k}) & state.keys()]
    if missing or result.unexpected_keys:
        raise SurgeryError(
            f"weights in {folder} do not match the rebuilt model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {result.unexpected_keys[:5]}"
            f"{'...' if len(result.unexpected_keys) > 5 else ''}. Was it saved with "
            "attnlab.save_pretrained, and is plan.json the plan it was saved with?"
        )
    return model.eval()
