"""Specs and typed configs: one grammar and one error format for every named thing.

A *spec* names a registered thing and its parameters: ``band(window=64)``,
``jat(rho=5, coef=0.5)``, ``lora(r=8)``, ``longformer(window=64, global_tokens=[0])``, or a
bare name ``softmax``. Values are Python literals (numbers, strings in quotes, True/False,
lists). YAML and JSON give the same as a mapping ``{"name": "band", "window": 64}``.

Mechanisms, tuners and experiment configs all go through this module, so they share
- one parser (:func:`parse_spec`), one type checker (:func:`coerce`) and one builder
  (:func:`build_config`: unknown parameters, types, the dataclass's own checks);
- one error format: ``unknown parameter 'windw' for mechanism 'band'; did you mean
  'window'? Known parameters: window.`` (:func:`unknown_parameter`), and
  ``unknown mechanism 'softmx'; did you mean 'softmax'? Known: ...`` (:func:`unknown_name`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any


class RegistryError(KeyError):
    """Unknown name or bad spec; the message names close matches and the fix."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` from the closest choices (case-insensitive), or ``""``.
    ``word`` may be any value (a YAML key can be a number or null)."""
    lower = {c.lower(): c for c in choices}
    hits = [lower[h] for h in difflib.get_close_matches(str(word).lower(), list(lower), n=3,
                                                        cutoff=0.5)]
    return f"; did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""


def unknown_name(kind: str, name: str, known: Sequence[str]) -> str:
    end = "" if did_you_mean(name, known) else "."
    return (f"unknown {kind} {name!r}{did_you_mean(name, known)}{end} "
            f"Known: {', '.join(sorted(known))}.")


def unknown_parameter(key: str, owner: str, known: Sequence[str]) -> str:
    hint = did_you_mean(key, known)
    return (f"unknown parameter {key!r} for {owner}{hint or '.'} "
            f"Known parameters: {', '.join(known) or '(none)'}.")


# ----------------------------------------------------------------------------- the grammar


def _literal(val: Any) -> str:
    if isinstance(val, tuple):
        return "[" + ", ".join(_literal(v) for v in val) + "]"
    return repr(val)


# Field metadata: the field is left out of the spec string while it has its default value.
# For a field added to a config whose spelling is already a key elsewhere (saved surgery
# tables, resumable bench rows, the "softmax" of heads a plan left alone), so that spelling
# stays the canonical one.
OMIT_DEFAULT: dict[str, Any] = {"spec": "omit_default"}


def _shown(cfg: Any, f: dataclasses.Field) -> bool:
    return (f.metadata.get("spec") != OMIT_DEFAULT["spec"]
            or getattr(cfg, f.name) != f.default)


def config_spec(cfg: Any) -> str:
    """The spec string that rebuilds the config dataclass ``cfg`` (its class-level ``name``
    and every field but those marked ``OMIT_DEFAULT`` at their default), e.g.
    ``band(window=64)``; the inverse of :func:`parse_spec`."""
    args = ", ".join(f"{f.name}={_literal(getattr(cfg, f.name))}"
                     for f in dataclasses.fields(cfg) if _shown(cfg, f))
    return f"{cfg.name}({args})" if args else cfg.name


def config_dict(cfg: Any) -> dict[str, Any]:
    """Plain-JSON form of a config dataclass: ``{"name": ..., **fields}`` (tuples -> lists)."""
    out: dict[str, Any] = {"name": cfg.name}
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        out[f.name] = list(val) if isinstance(val, tuple) else val
    return out


def parse_spec(spec: str, kind: str = "mechanism", example: str = "band(window=64)"
               ) -> tuple[str, dict[str, Any]]:
    """``"band(window=4)"`` -> ``("band", {"window": 4})``. Keyword arguments only.

    kind, example: what the spec names and a valid one, for the error messages.
    """
    text = spec.strip()
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise RegistryError(f"cannot parse {kind} spec {spec!r}: {e.msg}. Write it as "
                            f"name(key=value, ...), e.g. {example}") from None
    if isinstance(node, ast.Name):
        return node.id, {}
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise RegistryError(f"{kind} spec {spec!r} must look like name(key=value, ...), "
                            f"e.g. {example}")
    if node.args:
        raise RegistryError(f"{kind} spec {spec!r}: positional arguments are not allowed; "
                            f"name every value, e.g. {example}")
    kwargs: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise RegistryError(f"{kind} spec {spec!r}: ** is not allowed")
        if kw.arg in kwargs:
            raise RegistryError(f"{kind} spec {spec!r}: {kw.arg!r} is given twice; keep one")
        try:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            raise RegistryError(
                f"{kind} spec {spec!r}: value of {kw.arg!r} is not a literal "
                f"(numbers, strings in quotes, True/False, lists)") from None
    return node.func.id, kwargs


# ----------------------------------------------------------------------------- types

INT64 = 2**63  # ints must lie in [-INT64, INT64): torch and numpy take no larger


def coerce(where: str, tp: Any, val: Any, from_yaml: bool = False) -> Any:
    """``val`` checked (and lightly converted) against the annotation ``tp``.

    ints pass for floats; lists become tuples (a scalar a 1-tuple for ``tuple[X, ...]``);
    bool is not a number; a float must be finite (not nan or inf) and an int fit in 64 bits
    (what torch takes). from_yaml: also accept what YAML 1.1 reads as a string (``5e-5``
    for a float) and numbers for strings. Raises TypeError naming ``where``.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if val is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(where, a, val, from_yaml)
            except TypeError as e:
                errors.append(str(e))
        raise TypeError(errors[0] if len(errors) == 1 else
                        f"{where}: {val!r} is not a valid {tp}")
    if tp is Any:
        return val
    if origin is typing.Literal:
        if val not in args:
            raise TypeError(f"{where} must be one of {list(args)}, got {val!r}")
        return val
    if origin is list:
        if not isinstance(val, list):
            raise TypeError(f"{where} must be a list, got {val!r}")
        return val
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
            if not isinstance(val, (list, tuple)):
                val = [val]
            return tuple(coerce(where, args[0], v, from_yaml) for v in val)
        if not isinstance(val, (list, tuple)) or (args and len(val) != len(args)):
            raise TypeError(f"{where} must be a list of {len(args)} values, got {val!r}")
        return tuple(coerce(where, a, v, from_yaml) for a, v in zip(args, val, strict=True))
    if tp is float:
        if from_yaml and isinstance(val, str):  # YAML 1.1 reads 5e-5 (no dot) as a string
            try:
                val = float(val)
            except ValueError:
                raise TypeError(f"{where} must be a number, got {val!r}") from None
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            raise TypeError(f"{where} must be a number, got {val!r}")
        try:
            out = float(val)
        except OverflowError:  # an int beyond any float
            out = math.inf
        if not math.isfinite(out):
            raise TypeError(f"{where} must be a finite number, got {out!r}")
        return out
    if tp is int:
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{where} must be an integer, got {val!r}")
        if not -INT64 <= val < INT64:
            raise TypeError(f"{where} must be an integer below 2**63 in size (64 bits), got "
                            f"{val}")
        return val
    if tp is bool:
        if not isinstance(val, bool):
            raise TypeError(f"{where} must be true or false, got {val!r}")
        return val
    if tp is str:
        if from_yaml and isinstance(val, (int, float)) and not isinstance(val, bool):
            return str(val)
        if not isinstance(val, str):
            raise TypeError(f"{where} must be a string, got {val!r}")
        return val
    return val


def build_config(config_cls: type, kwargs: Mapping[str, Any], owner: str) -> Any:
    """``config_cls(**kwargs)`` with every value checked: unknown parameters, types, and the
    dataclass's own ``__post_init__`` checks all raise :class:`RegistryError`.

    owner: what the parameters belong to, e.g. ``"mechanism 'band'"``.
    """
    fields = [f.name for f in dataclasses.fields(config_cls)]
    hints = typing.get_type_hints(config_cls)
    clean: dict[str, Any] = {}
    for key, val in kwargs.items():
        if key not in fields:
            raise RegistryError(unknown_parameter(key, owner, fields))
        try:
            clean[key] = coerce(f"{getattr(config_cls, 'name', owner)}.{key}", hints[key], val)
        except TypeError as e:
            raise RegistryError(str(e)) from None
    try:
        return config_cls(**clean)
    except (ValueError, TypeError) as e:
        raise RegistryError(f"invalid {owner} config: {e}") from None


def split_spec(spec: str | Mapping[str, Any] | object, kind: str, example: str
               ) -> tuple[str, dict[str, Any]]:
    """A spec string or a mapping ``{"name": ..., **parameters}`` -> (name, parameters)."""
    if isinstance(spec, str):
        return parse_spec(spec, kind, example)
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        if "name" not in kwargs:
            raise RegistryError(f"{kind} mapping {dict(spec)!r} needs a 'name' key")
        name = kwargs.pop("name")
        if not isinstance(name, str):
            raise RegistryError(f"{kind} mapping {dict(spec)!r}: 'name' must be a string "
                                f"naming one, e.g. {example}")
        return name, kwargs
    raise TypeError(f"{kind} spec must be a string, mapping or config, got {type(spec)}")


def split_top(text: str, sep: str, maxsplit: int = -1) -> list[str]:
    """Split on ``sep`` outside brackets and quotes (specs contain commas, colons in strings)."""
    parts: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0 and (maxsplit < 0 or len(parts) < maxsplit):
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return parts
