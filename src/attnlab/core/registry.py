"""One generic registry and the mechanism registry.

A :class:`Registry` maps lower-snake-case names to things (mechanism classes, tuners, head
scorers, tasks) with close-match errors; when its things carry a ``config_cls`` it also
turns a spec (``band(window=64)``, a mapping, or a config) into that config
(:meth:`Registry.config`), through the one grammar of :mod:`attnlab.core.spec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar, cast

from torch import nn

from .protocol import Capabilities, HeadDims, MechanismConfig
from .spec import RegistryError, build_config, split_spec, unknown_name

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> object, with helpful errors.

    kind: what is registered (for messages); example: a valid spec (for messages).
    """

    def __init__(self, kind: str, example: str | None = None) -> None:
        self.kind = kind
        self.example = example or kind
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T) -> T:
        if not name or name != name.lower() or not name.replace("_", "").isalnum():
            raise ValueError(f"{self.kind} name {name!r} must be lower snake case")
        if name in self._items and self._items[name] is not obj:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj
        return obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(unknown_name(self.kind, name, list(self._items))) from None

    def config(self, spec: str | Mapping[str, Any] | Any) -> Any:
        """Spec string, mapping ``{"name": ..., **parameters}`` or config -> the config of the
        registered thing (its ``config_cls``, or the thing itself when it is a config
        dataclass, like a head scorer), every parameter checked."""
        if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
            self.get(cast(Any, spec).name)  # a config of something registered here (all
            # registered configs carry a class-level name; DataclassInstance does not say so)
            return spec
        name, kwargs = split_spec(spec, self.kind, self.example)
        item = self.get(name)
        # things registered here carry a config_cls, or are the config class themselves
        config_cls = cast(type, getattr(item, "config_cls", item))
        return build_config(config_cls, kwargs, f"{self.kind} {name!r}")

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


class MechanismClass(Protocol):
    """What the registry knows of a registered mechanism class: its class-level declarations
    (``caps``, ``example``, and ``config_cls`` set by :func:`register_mechanism`), and that
    ``Cls(cfg, dims)`` builds the module."""

    __name__: str
    caps: Capabilities
    example: str
    config_cls: type[MechanismConfig]

    def __call__(self, cfg: MechanismConfig, dims: HeadDims) -> nn.Module: ...


MECHANISMS: Registry[MechanismClass] = Registry("mechanism", example="band(window=64)")


def register_mechanism(config_cls: type[MechanismConfig]) -> Callable[[type], type]:
    """Class decorator: ``@register_mechanism(BandConfig)`` registers under ``BandConfig.name``.

    The class must declare ``caps: ClassVar[Capabilities]``; it gets ``config_cls``.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, MechanismConfig)):
        raise TypeError("register_mechanism takes a MechanismConfig subclass")
    if not dataclasses.is_dataclass(config_cls) or not config_cls.name:
        raise TypeError(f"{config_cls.__name__} must be a dataclass with a class-level name")

    def deco(cls: type) -> type:
        if not hasattr(cls, "caps"):
            raise TypeError(f"{cls.__name__} must declare caps: ClassVar[Capabilities]")
        mech_cls = cast(MechanismClass, cls)  # caps checked above, config_cls set here
        mech_cls.config_cls = config_cls
        MECHANISMS.register(config_cls.name, mech_cls)
        return cls

    return deco


def list_mechanisms() -> list[str]:
    """Registered mechanism names, sorted (``import attnlab`` registers the built-ins)."""
    return MECHANISMS.names()


def mechanism_class(name: str) -> MechanismClass:
    return MECHANISMS.get(name)


def resolve_config(spec: str | Mapping[str, Any] | MechanismConfig) -> MechanismConfig:
    """Spec string, mapping ``{"name": ..., **kw}`` or config -> config instance."""
    return MECHANISMS.config(spec)


def build_mechanism(spec: str | Mapping[str, Any] | MechanismConfig, dims: HeadDims):
    """Build a mechanism module from a spec and the host's head dimensions."""
    cfg = resolve_config(spec)
    cls = mechanism_class(cfg.name)
    if cls.caps.needs_max_len and dims.max_len is None:
        raise ValueError(
            f"mechanism {cfg.name!r} needs HeadDims.max_len (its parameters are sized by the "
            "maximum sequence length); pass HeadDims(num_heads, head_dim, max_len=...)"
        )
    return cls(cfg, dims)
