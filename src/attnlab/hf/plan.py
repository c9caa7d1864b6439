"""Plan: which layers and heads get which mechanism.

A plan is an ordered list of rules ``Rule(layers, heads, mechanism)``. Later rules win;
heads no rule matches stay plain ``softmax``. Layer and head indices are 0-based.

Accepted forms (all parse to the same :class:`Plan`):

* a list of mappings, as in YAML::

      - {layers: all, heads: all, mechanism: band(window=64)}
      - {layers: [1, 2, 3], heads: "0-5", mechanism: {name: jat, rho: 5}}

* a JSON or YAML string of that list (or of ``{plan: [...]}``);
* compact command-line strings ``"LAYERS:HEADS:SPEC"`` such as ``"0-2:all:band(window=8)"``,
  given as a list or joined with ``;`` (a bare ``SPEC`` means ``all:all:SPEC``).

Heads may also be chosen by what they do, with a :class:`HeadSelector` instead of indices:
``class:vertical`` (any head class of ``attnlab.analysis``: ``vertical``, ``diagonal``,
``vertical+diagonal``, ``block``, ``heterogeneous``) or a threshold on one score of a head
analysis, ``vertical>=0.8`` / ``entropy<1.5`` (operators ``>=``, ``>``, ``<=``, ``<``). In the
compact form a class selector is the one place where HEADS holds a colon:
``"all:class:vertical:band(window=8)"`` (four top-level fields, the second being ``class``);
thresholds hold none (``"0-2:entropy<1.5:band(window=8)"``). A selector stays symbolic here:
this layer knows no analysis. ``attnlab.recipes.head_select.resolve_plan`` turns it into
explicit indices (one rule per group of layers) before ``apply_plan``, which refuses a plan
that still holds one, and the explicit plan is what ``plan.json`` saves.

Mechanisms are resolved with ``core.resolve_config`` while parsing, so an unknown mechanism
or key fails at once, and the error names the rule.

YAML pitfalls: inside a flow mapping ``{...}`` a spec with several arguments must be quoted
(``mechanism: "jat(rho=5, coef=0.5)"``), since YAML splits flow mappings on commas; and YAML
1.1 reads ``1e-3`` (no dot) as a string, so write ``1.0e-3`` in mapping values (inside a
spec string any Python literal works).

This module does not import transformers: plans are plain data, checked against a model's
shape only by :meth:`Plan.resolve` (and fully by ``hf.surgery.apply_plan``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from ..core import MechanismConfig, RegistryError, resolve_config, unknown_parameter
from ..core.spec import split_top

All = Literal["all"]
Indices = All | tuple[int, ...]

SOFTMAX = "softmax"


class PlanError(ValueError):
    """A plan that cannot be parsed or does not fit the model; the message names the rule."""


# ------------------------------------------------------------------------------ index parsing


# No model has this many layers or heads: a larger index (a range 0-99999999999 would be
# a list of that many) is a typo, refused before it is expanded.
MAX_INDEX = 65535


def _index_in_reach(index: int, what: str) -> int:
    if index > MAX_INDEX:
        raise PlanError(f"{what}: index {index} is larger than any model's layers or heads "
                        f"(at most {MAX_INDEX}); write indices of the model, or 'all'")
    return index


def _parse_index_item(item: Any, what: str) -> list[int]:
    """One element of a layers/heads list: an int, or a string "3", "0-2" or "1,4-5"."""
    if isinstance(item, bool):
        raise PlanError(f"{what}: {item!r} is not an index; use ints, 'a-b' ranges or 'all'")
    if isinstance(item, int):
        if item < 0:
            raise PlanError(f"{what}: negative index {item}; indices are 0-based and >= 0")
        return [_index_in_reach(item, what)]
    if isinstance(item, str):
        out: list[int] = []
        for part in item.replace(" ", "").split(","):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                a = int(lo)
                b = int(hi) if sep else a
                if min(a, b) < 0:  # "0--2": a range to a negative index
                    raise ValueError
            except ValueError:
                raise PlanError(
                    f"{what}: cannot read {item!r}; write 'all', an int, a list of ints, or "
                    "ranges such as '0-2' or '0-2,5'"
                ) from None
            if b < a:
                raise PlanError(f"{what}: range {part!r} runs backwards; write '{b}-{a}'")
            out.extend(range(a, _index_in_reach(b, what) + 1))
        if not out:
            raise PlanError(f"{what}: empty index string {item!r}")
        return out
    raise PlanError(f"{what}: {item!r} is not an index; use ints, 'a-b' ranges or 'all'")


def parse_indices(value: Any, what: str) -> Indices:
    """``"all"`` | int | "0-2" | "0-2,5" | list of those -> "all" or a sorted tuple of ints."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return "all"
    if isinstance(value, (list, tuple)):
        if not value:
            raise PlanError(f"{what}: empty list; name at least one index or write 'all'")
        idx = [i for item in value for i in _parse_index_item(item, what)]
    else:
        idx = _parse_index_item(value, what)
    return tuple(sorted(set(idx)))


def _is_index_tuple(value: Any) -> bool:
    return (
        isinstance(value, tuple) and len(value) > 0
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        and list(value) == sorted(set(value))
    )


def _indices_text(idx: Indices) -> str:
    """Compact text of an index set: "all", "3", "0-2", "0-2,5"."""
    if idx == "all":
        return "all"
    parts: list[str] = []
    start = prev = idx[0]
    for i in (*idx[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


# ------------------------------------------------------------------------------ head selectors

CLASS_PREFIX = "class:"
SCORE_OPS = (">=", "<=", ">", "<")  # longest first, so ">=" is not read as ">"
_THRESHOLD = re.compile(
    r"\s*([A-Za-z_]\w*(?:\([^()]*\))?)\s*(>=|<=|>|<)\s*"
    r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*")


@dataclass(frozen=True)
class HeadSelector:
    """Heads chosen by a head analysis: ``class:NAME`` or ``SCORE OP VALUE`` (symbolic).

    Resolved against an analysis by ``attnlab.recipes.head_select.resolve_plan``; the class
    names and score labels are checked there, against the analysis (this module imports no
    analysis).
    """

    kind: str  # "class" (a head class) or "score" (a threshold on a score)
    name: str  # the class name, or the score label as in head_scores.json ("entropy")
    op: str = ""  # score only: one of SCORE_OPS
    value: float = 0.0  # score only: the threshold

    def __str__(self) -> str:
        if self.kind == "class":
            return f"{CLASS_PREFIX}{self.name}"
        return f"{self.name}{self.op}{self.value!r}"

    def matches(self, score: float) -> bool:
        """The threshold test for one head's score (False for NaN)."""
        return {">=": score >= self.value, ">": score > self.value,
                "<=": score <= self.value, "<": score < self.value}[self.op]


def parse_selector(value: Any) -> HeadSelector | None:
    """``"class:vertical"`` or ``"entropy<1.5"`` -> HeadSelector; anything else -> None."""
    if isinstance(value, HeadSelector):
        return value
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.lower() == CLASS_PREFIX[:-1]:
        raise PlanError(f"heads {value!r}: name the class, as class:vertical (compact form "
                        "LAYERS:class:NAME:SPEC, e.g. all:class:vertical:band(window=8))")
    if text.lower().startswith(CLASS_PREFIX):
        name = text[len(CLASS_PREFIX):].strip()
        if not name:
            raise PlanError(f"heads {value!r}: name the class, e.g. class:vertical")
        return HeadSelector("class", name)
    m = _THRESHOLD.fullmatch(text)
    if m is None:
        if any(op in text for op in SCORE_OPS):
            raise PlanError(f"heads {value!r}: write a threshold as SCORE OP NUMBER with OP "
                            "one of >=, >, <=, <, e.g. vertical>=0.8 or entropy<1.5")
        return None
    return HeadSelector("score", m.group(1), m.group(2), float(m.group(3)))


def _parse_heads(value: Any, what: str) -> Indices | HeadSelector:
    """Heads of a rule: indices as :func:`parse_indices`, or a :class:`HeadSelector`."""
    selector = parse_selector(value)
    return selector if selector is not None else parse_indices(value, what)


# ------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """Give ``mechanism`` to ``heads`` of ``layers`` ("all" or sorted 0-based indices; heads
    may also be a :class:`HeadSelector`, to be resolved against a head analysis)."""

    layers: Indices
    heads: Indices | HeadSelector
    mechanism: MechanismConfig

    def __post_init__(self) -> None:
        # Accept the loose forms too: Rule("0-2", "all", "band(window=8)").
        if not (self.layers == "all" or _is_index_tuple(self.layers)):
            object.__setattr__(self, "layers", parse_indices(self.layers, "Rule.layers"))
        if not (self.heads == "all" or _is_index_tuple(self.heads)
                or isinstance(self.heads, HeadSelector)):
            object.__setattr__(self, "heads", _parse_heads(self.heads, "Rule.heads"))
        if not isinstance(self.mechanism, MechanismConfig):
            try:
                object.__setattr__(self, "mechanism", resolve_config(self.mechanism))
            except (RegistryError, TypeError) as e:
                raise PlanError(f"Rule.mechanism: {e}") from None

    @property
    def selector(self) -> HeadSelector | None:
        """The rule's HeadSelector, or None when its heads are indices."""
        return self.heads if isinstance(self.heads, HeadSelector) else None

    def describe(self) -> str:
        """Compact form ``LAYERS:HEADS:SPEC``, also accepted by :meth:`Plan.parse`."""
        heads = str(self.heads) if isinstance(self.heads, HeadSelector) else _indices_text(
            self.heads)
        return f"{_indices_text(self.layers)}:{heads}:{self.mechanism.spec()}"

    def to_dict(self) -> dict[str, Any]:
        def idx(v: Indices | HeadSelector) -> str | list[int]:
            if isinstance(v, HeadSelector):
                return str(v)
            return "all" if v == "all" else list(v)

        return {
            "layers": idx(self.layers),
            "heads": idx(self.heads),
            "mechanism": self.mechanism.to_dict(),
        }


def _rule_from_mapping(raw: Mapping[str, Any], pos: int, text: str | None = None) -> Rule:
    """One rule from its mapping; ``text``: the compact form it was written in, which errors
    quote instead of the mapping."""
    where = f"plan rule {pos} ({text if text is not None else dict(raw)!r})"
    unknown = sorted(set(raw) - {"layers", "heads", "mechanism"}, key=str)  # keys of any type
    if unknown:
        raise PlanError(f"{where}: " + unknown_parameter(unknown[0], "a plan rule",
                                                          ["layers", "heads", "mechanism"]))
    if "mechanism" not in raw:
        raise PlanError(f"{where}: missing 'mechanism', e.g. mechanism: band(window=64)")
    layers = parse_indices(raw.get("layers", "all"), f"{where}, layers")
    try:
        heads = _parse_heads(raw.get("heads", "all"), "heads")  # the rule is named below
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None
    try:
        mech = resolve_config(raw["mechanism"])
    except (RegistryError, TypeError) as e:
        raise PlanError(f"{where}: {e}") from None
    return Rule(layers, heads, mech)


def _rule_from_compact(text: str, pos: int) -> Rule:
    """``"0-2:all:band(window=8)"``; a bare ``"band(window=8)"`` means all layers, all heads;
    ``"all:class:vertical:band(window=8)"``: HEADS is the class selector ``class:vertical``.

    Unambiguous: a spec never holds a colon outside brackets and quotes, so the top-level
    fields are 1 (SPEC), 3 (LAYERS:HEADS:SPEC) or 4 with ``class`` second."""
    fields = split_top(text.strip(), ":")
    if len(fields) == 1:
        fields = ["all", "all", fields[0]]
    elif len(fields) == 4 and fields[1].strip().lower() == CLASS_PREFIX[:-1]:
        fields = [fields[0], f"{CLASS_PREFIX}{fields[2].strip()}", fields[3]]
    elif len(fields) != 3:
        raise PlanError(
            f"plan rule {pos} ({text!r}): write LAYERS:HEADS:SPEC, e.g. '0-2:all:band(window=8)'"
            " or 'all:class:vertical:band(window=8)'"
        )
    layers, heads, spec = (f.strip() for f in fields)
    return _rule_from_mapping({"layers": layers, "heads": heads, "mechanism": spec}, pos,
                              text.strip())


# -------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """Ordered rules; later rules win; unmatched heads stay softmax."""

    rules: tuple[Rule, ...] = ()

    # -- parsing -------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: Any) -> Plan:
        """Plan | list of mappings/Rules/compact strings | JSON/YAML/compact string | mapping.

        A mapping is one rule, or ``{"plan": [...]}`` (the YAML experiment-config form).
        """
        if isinstance(spec, Plan):
            return spec
        if isinstance(spec, Rule):
            return cls((spec,))
        if isinstance(spec, str):
            return cls._parse_text(spec)
        if isinstance(spec, Mapping):
            if set(spec) == {"plan"}:
                return cls.parse(spec["plan"])
            return cls((_rule_from_mapping(spec, 0),))
        if isinstance(spec, Iterable):
            rules: list[Rule] = []
            for pos, item in enumerate(spec):
                if isinstance(item, Rule):
                    rules.append(item)
                elif isinstance(item, Mapping):
                    rules.append(_rule_from_mapping(item, pos))
                elif isinstance(item, str):
                    rules.append(_rule_from_compact(item, pos))
                else:
                    raise PlanError(
                        f"plan rule {pos}: {item!r} is neither a mapping "
                        "{layers, heads, mechanism} nor a string 'LAYERS:HEADS:SPEC'"
                    )
            return cls(tuple(rules))
        raise PlanError(f"cannot read a plan from {type(spec).__name__}: {spec!r}")

    @classmethod
    def _parse_text(cls, text: str) -> Plan:
        s = text.strip()
        if not s:
            return cls()
        if s[0] in "[{-" or "\n" in s:
            try:  # JSON first: YAML 1.1 reads JSON's 1e-06 as a string
                return cls.parse(json.loads(s))
            except json.JSONDecodeError:
                pass
            try:
                data = yaml.safe_load(s)
            except yaml.YAMLError as e:
                raise PlanError(f"cannot parse the plan as JSON/YAML: {e}") from None
            if not isinstance(data, str):
                return cls.parse(data if data is not None else [])
            s = data.strip()  # a YAML string ("-1:all:band", quoted or not): compact rules
        return cls(tuple(_rule_from_compact(p, i) for i, p in enumerate(split_top(s, ";"))
                         if p.strip()))

    # -- resolution ----------------------------------------------------------------------
    @property
    def selective(self) -> bool:
        """Whether a rule still chooses its heads with a :class:`HeadSelector`."""
        return any(r.selector is not None for r in self.rules)

    def resolve_with_rules(
        self, num_layers: int, num_heads: int
    ) -> dict[int, dict[int, tuple[MechanismConfig, int | None]]]:
        """{layer: {head: (config, index of the rule that set it or None)}} for every head.

        Raises :class:`PlanError` naming the rule when an index is out of range, or when a
        rule still holds a :class:`HeadSelector` (resolve it against an analysis first).
        """
        softmax = resolve_config(SOFTMAX)
        table: dict[int, dict[int, tuple[MechanismConfig, int | None]]] = {
            layer: {head: (softmax, None) for head in range(num_heads)}
            for layer in range(num_layers)
        }
        for pos, rule in enumerate(self.rules):
            if isinstance(rule.heads, HeadSelector):
                raise PlanError(
                    f"plan rule {pos} ({rule.describe()}) chooses heads by a head analysis "
                    f"({rule.selector}) that was not given; pass one: --analysis "
                    "head_scores.json (or task:NAME), analysis: in the config, or in Python "
                    "attnlab.recipes.head_select.resolve_plan(plan, table)")
            layers = range(num_layers) if rule.layers == "all" else rule.layers
            heads = range(num_heads) if rule.heads == "all" else rule.heads
            _check_range(pos, rule, "layer", layers, num_layers)
            _check_range(pos, rule, "head", heads, num_heads)
            for layer in layers:
                for head in heads:
                    table[layer][head] = (rule.mechanism, pos)
        return table

    def resolve(self, num_layers: int, num_heads: int) -> dict[int, dict[int, MechanismConfig]]:
        """{layer: {head: config}} for every layer and head of a model of this shape."""
        full = self.resolve_with_rules(num_layers, num_heads)
        return {layer: {h: cfg for h, (cfg, _) in heads.items()} for layer, heads in full.items()}

    # -- serialisation -------------------------------------------------------------------
    def to_list(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.rules]

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"plan": self.to_list()}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        return cls.parse(data)

    def __str__(self) -> str:
        return "; ".join(r.describe() for r in self.rules) if self.rules else "(all softmax)"

    def mechanisms(self) -> list[str]:
        """Names of the mechanisms this plan uses, in rule order, without repeats."""
        return list(dict.fromkeys(r.mechanism.name for r in self.rules))


def _check_range(pos: int, rule: Rule, what: str, idx: Sequence[int], count: int) -> None:
    bad = [i for i in idx if i >= count]
    if bad:
        plural = "layers" if what == "layer" else "heads"
        raise PlanError(
            f"plan rule {pos} ({rule.describe()}): {what} index {bad[0]} is out of range; the "
            f"model has {count} {plural} (valid {what} indices 0-{count - 1}). Fix the rule's "
            f"{plural}, or write 'all'."
        )
