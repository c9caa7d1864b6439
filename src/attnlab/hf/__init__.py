"""The Hugging Face layer: the only part of attnlab that imports transformers.

backend  the "attnlab" attention function (registered on import) and per-forward state
plan     Plan = ordered rules {layers, heads, mechanism}
arch     where each model family keeps its self-attention modules
surgery  apply_plan(model, plan) -> SurgeryReport
saving   save_pretrained / load_pretrained with the plan
capture  capture_attention(model, batch) -> AttentionCache
fused    fused-QKV hosts (ModernBERT) and local (sliding-window) layers
check    check_model_config(model, plan): refuse from the config what run would refuse
headmask head_mask(model, mask): scale each head's output (Michel et al.'s xi)
"""

from .arch import Host, UnsupportedModelError, inspect_model
from .backend import AttnlabLayer, attnlab_attention, aux_loss, register_backend, set_task_id
from .capture import AttentionCache, capture_attention
from .check import check_model_config
from .headmask import head_mask
from .plan import Plan, PlanError, Rule
from .saving import load_pretrained, save_pretrained
from .surgery import SurgeryError, SurgeryReport, applied_report, apply_plan

__all__ = [
    "AttentionCache",
    "AttnlabLayer",
    "Host",
    "Plan",
    "PlanError",
    "Rule",
    "SurgeryError",
    "SurgeryReport",
    "UnsupportedModelError",
    "applied_report",
    "apply_plan",
    "attnlab_attention",
    "aux_loss",
    "capture_attention",
    "check_model_config",
    "head_mask",
    "inspect_model",
    "load_pretrained",
    "register_backend",
    "save_pretrained",
    "set_task_id",
]
