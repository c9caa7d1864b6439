"""One generic registry, the mechanism registry, and the spec-string parser.

Spec strings: ``band(window=64)``, ``jat(rho=5, coef=0.5)``,
``longformer(window=64, global_tokens=[0])``, or a bare name ``softmax``. Values are Python
literals (ints, floats, strings, bools, lists). YAML/JSON give the same as a mapping
``{"name": "band", "window": 64}``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from .protocol import HeadDims, MechanismConfig

T = TypeVar("T")


class RegistryError(KeyError):
    """Unknown name or bad spec; the message names close matches and the fix."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


def _close(word: str, choices: list[str]) -> str:
    """" Did you mean ...?" from the closest choices, case-insensitively (BAND -> band)."""
    lower = {c.lower(): c for c in choices}
    hits = [lower[h] for h in difflib.get_close_matches(word.lower(), list(lower), n=3,
                                                        cutoff=0.5)]
    return f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""


class Registry(Generic[T]):
    """Name -> object, with helpful errors. ``kind`` names what is registered (for messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
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
            raise RegistryError(
                f"unknown {self.kind} {name!r}.{_close(name, list(self._items))} "
                f"Known: {', '.join(sorted(self._items))}."
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


MECHANISMS: Registry[type] = Registry("mechanism")


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
        cls.config_cls = config_cls
        MECHANISMS.register(config_cls.name, cls)
        return cls

    return deco


def list_mechanisms() -> list[str]:
    """Registered mechanism names, sorted (``import attnlab`` registers the built-ins)."""
    return MECHANISMS.names()


def mechanism_class(name: str) -> type:
    return MECHANISMS.get(name)


# ----------------------------------------------------------------------------- spec parsing


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"band(window=4)"`` -> ``("band", {"window": 4})``. Only keyword arguments."""
    text = spec.strip()
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise RegistryError(
            f"cannot parse mechanism spec {spec!r}: {e.msg}. "
            "Write it as name(key=value, ...), e.g. band(window=64)"
        ) from None
    if isinstance(node, ast.Name):
        return node.id, {}
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise RegistryError(f"mechanism spec {spec!r} must look like name(key=value, ...)")
    if node.args:
        raise RegistryError(
            f"mechanism spec {spec!r}: positional arguments are not allowed; "
            "name every value, e.g. band(window=64)"
        )
    kwargs: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise RegistryError(f"mechanism spec {spec!r}: ** is not allowed")
        try:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            raise RegistryError(
                f"mechanism spec {spec!r}: value of {kw.arg!r} is not a literal "
                f"(numbers, strings in quotes, True/False, lists)"
            ) from None
    return node.func.id, kwargs


def _coerce(cfg_name: str, fname: str, ftype: Any, val: Any) -> Any:
    """Light type checking: ints for floats, lists -> tuples, bool is not an int."""
    origin = typing.get_origin(ftype)
    args = typing.get_args(ftype)
    if origin in (typing.Union, types.UnionType):
        if val is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(cfg_name, fname, a, val)
            except TypeError as e:
                errors.append(str(e))
        raise TypeError(errors[0] if errors else f"{cfg_name}.{fname}: bad value {val!r}")
    if origin is typing.Literal:
        if val not in args:
            raise TypeError(f"{cfg_name}.{fname} must be one of {list(args)}, got {val!r}")
        return val
    if origin is tuple:
        if not isinstance(val, (list, tuple)):
            val = [val]
        inner = args[0] if args else Any
        return tuple(_coerce(cfg_name, fname, inner, v) for v in val)
    if ftype is float:
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            raise TypeError(f"{cfg_name}.{fname} must be a number, got {val!r}")
        return float(val)
    if ftype is int:
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{cfg_name}.{fname} must be an integer, got {val!r}")
        return val
    if ftype is bool:
        if not isinstance(val, bool):
            raise TypeError(f"{cfg_name}.{fname} must be True or False, got {val!r}")
        return val
    if ftype is str:
        if not isinstance(val, str):
            raise TypeError(f"{cfg_name}.{fname} must be a string, got {val!r}")
        return val
    return val


def make_config(config_cls: type[MechanismConfig], kwargs: Mapping[str, Any]) -> MechanismConfig:
    """Build a config from keyword values, with close-match errors for unknown keys."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    clean: dict[str, Any] = {}
    for key, val in kwargs.items():
        if key not in fields:
            known = ", ".join(fields) or "(none)"
            raise RegistryError(
                f"unknown key {key!r} for mechanism {config_cls.name!r}."
                f"{_close(key, list(fields))} Known keys: {known}."
            )
        try:
            clean[key] = _coerce(config_cls.name, key, hints[key], val)
        except TypeError as e:
            raise RegistryError(str(e)) from None
    try:
        return config_cls(**clean)
    except (ValueError, TypeError) as e:
        raise RegistryError(f"invalid {config_cls.name} config: {e}") from None


def resolve_config(spec: str | Mapping[str, Any] | MechanismConfig) -> MechanismConfig:
    """Spec string, mapping ``{"name": ..., **kw}`` or config -> config instance."""
    if isinstance(spec, MechanismConfig):
        return spec
    if isinstance(spec, str):
        name, kwargs = parse_spec(spec)
    elif isinstance(spec, Mapping):
        kwargs = dict(spec)
        if "name" not in kwargs:
            raise RegistryError(f"mechanism mapping {dict(spec)!r} needs a 'name' key")
        name = kwargs.pop("name")
    else:
        raise TypeError(f"mechanism spec must be a string, mapping or config, got {type(spec)}")
    cls = mechanism_class(name)
    return make_config(cls.config_cls, kwargs)


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
