"""The spine: protocol, registry, reference oracle, masks. Imports torch and nothing of ours."""

from .masks import key_mask_from_lengths, pattern_bias
from .protocol import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    Mechanism,
    MechanismConfig,
    check_qkv,
)
from .reference import causal_mask, masked_softmax, reference_attention
from .registry import (
    MECHANISMS,
    Registry,
    RegistryError,
    build_mechanism,
    list_mechanisms,
    make_config,
    mechanism_class,
    parse_spec,
    register_mechanism,
    resolve_config,
)

__all__ = [
    "MECHANISMS",
    "AttnContext",
    "AttnOutput",
    "Capabilities",
    "HeadDims",
    "Mechanism",
    "MechanismConfig",
    "Registry",
    "RegistryError",
    "build_mechanism",
    "causal_mask",
    "check_qkv",
    "key_mask_from_lengths",
    "list_mechanisms",
    "make_config",
    "masked_softmax",
    "mechanism_class",
    "parse_spec",
    "pattern_bias",
    "reference_attention",
    "register_mechanism",
    "resolve_config",
]
