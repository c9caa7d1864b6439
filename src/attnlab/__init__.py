"""attnlab: a PyTorch laboratory for Transformer attention.

One protocol over the map of attention variants, usable in chosen layers and heads of a
Hugging Face encoder, with every fast path checked against an exact reference.
"""

from importlib import import_module as _import_module

from . import mechanisms  # noqa: F401  (registers the built-in mechanisms)
from .core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    build_mechanism,
    list_mechanisms,
    reference_attention,
    register_mechanism,
)

__version__ = "0.1.0"

_LAZY = {
    "Plan": ("attnlab.hf.plan", "Plan"),
    "apply_plan": ("attnlab.hf.surgery", "apply_plan"),
    "SurgeryReport": ("attnlab.hf.surgery", "SurgeryReport"),
    "load_pretrained": ("attnlab.hf.saving", "load_pretrained"),
    "save_pretrained": ("attnlab.hf.saving", "save_pretrained"),
    "aux_loss": ("attnlab.hf.backend", "aux_loss"),
    "get_task": ("attnlab.tasks", "get_task"),
    "list_tasks": ("attnlab.tasks", "list_tasks"),
    "resolve_tuning": ("attnlab.tuning", "resolve_tuning"),
    "list_tuners": ("attnlab.tuning", "list_tuners"),
    "capture_attention": ("attnlab.hf.capture", "capture_attention"),
    "AttentionCache": ("attnlab.hf.capture", "AttentionCache"),
    "load_default_model": ("attnlab.models", "load_default_model"),
    "encoder_config": ("attnlab.models", "encoder_config"),
}


def __getattr__(name: str):
    # transformers is imported only when a Hugging Face entry point is first used.
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(_import_module(mod), attr)
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


__all__ = [
    "AttnContext",
    "AttnOutput",
    "Capabilities",
    "HeadDims",
    "MechanismConfig",
    "build_mechanism",
    "list_mechanisms",
    "reference_attention",
    "register_mechanism",
    *_LAZY,
]
