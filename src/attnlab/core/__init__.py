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
    build_mechanism,
    list_mechanisms,
    mechanism_class,
    register_mechanism,
    resolve_config,
)
from .spec import (
    OMIT_DEFAULT,
    RegistryError,
    build_config,
    coerce,
    config_dict,
    config_spec,
    did_you_mean,
    parse_spec,
    split_spec,
    unknown_name,
    unknown_parameter,
)

__all__ = [
    "MECHANISMS",
    "OMIT_DEFAULT",
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
    "build_config",
    "coerce",
    "config_dict",
    "config_spec",
    "did_you_mean",
    "masked_softmax",
    "mechanism_class",
    "parse_spec",
    "split_spec",
    "unknown_name",
    "unknown_parameter",
    "pattern_bias",
    "reference_attention",
    "register_mechanism",
    "resolve_config",
]
