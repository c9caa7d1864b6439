"""Plan parsing, resolution and serialisation (no model needed)."""

from __future__ import annotations

import pytest

import attnlab
from attnlab.core import resolve_config
from attnlab.hf.plan import Plan, PlanError, Rule, parse_indices

SOFTMAX = resolve_config("softmax")
LINEAR = resolve_config("linear_elu")


def test_all_forms_parse_to_the_same_plan():
    rules = [
        {"layers": "all", "heads": "all", "mechanism": "linear_elu"},
        {"layers": [1, 2], "heads": "0-1", "mechanism": {"name": "linear_elu", "eps": 1e-3}},
    ]
    ref = Plan.parse(rules)
    yaml_text = """
- {layers: all, heads: all, mechanism: linear_elu}
- layers: [1, 2]
  heads: 0-1
  mechanism: linear_elu(eps=0.001)
"""
    forms = [
        ref,
        Plan.parse(yaml_text),
        Plan.parse({"plan": rules}),
        Plan.parse(ref.to_json()),
        Plan.from_json(ref.to_json()),
        Plan.parse(["all:all:linear_elu", "1-2:0,1:linear_elu(eps=1e-3)"]),
        Plan.parse("all:all:linear_elu; 1,2:0-1:linear_elu(eps=0.001)"),
        Plan.parse([ref.rules[0], "1-2:0-1:linear_elu(eps=0.001)"]),
    ]
    for p in forms:
        assert p == ref
    assert ref.rules[1] == Rule((1, 2), (0, 1), resolve_config("linear_elu(eps=0.001)"))
    assert attnlab.Plan is Plan


def test_bare_spec_means_all_layers_all_heads():
    assert Plan.parse("linear_elu") == Plan((Rule("all", "all", LINEAR),))


def test_describe_round_trips_through_compact_form():
    p = Plan.parse([{"layers": [0, 1, 2, 5], "heads": [3], "mechanism": "linear_elu"}])
    assert p.rules[0].describe() == "0-2,5:3:linear_elu(eps=1e-06, chunk=64)"
    assert Plan.parse(str(p)) == p
    assert str(Plan()) == "(all softmax)"


def test_indices():
    assert parse_indices("all", "x") == "all"
    assert parse_indices(3, "x") == (3,)
    assert parse_indices("0-2", "x") == (0, 1, 2)
    assert parse_indices(["4", 1, "0-1"], "x") == (0, 1, 4)
    for bad in ["2-0", "a", -1, True, [], "", 1.5]:
        with pytest.raises(PlanError):
            parse_indices(bad, "x")


def test_resolve_later_rules_win_and_unmatched_stay_softmax():
    p = Plan.parse(["all:all:linear_elu", "1:0,2:softmax"])
    table = p.resolve(num_layers=2, num_heads=4)
    assert table[0] == {h: LINEAR for h in range(4)}
    assert table[1] == {0: SOFTMAX, 1: LINEAR, 2: SOFTMAX, 3: LINEAR}
    assert Plan().resolve(1, 2) == {0: {0: SOFTMAX, 1: SOFTMAX}}
    full = p.resolve_with_rules(2, 4)
    assert full[1][0] == (SOFTMAX, 1) and full[1][1] == (LINEAR, 0)


def test_unknown_mechanism_names_the_rule():
    with pytest.raises(PlanError, match=r"rule 1 .*unknown mechanism 'lineer_elu'.*linear_elu"):
        Plan.parse(["all:all:softmax", "0:all:lineer_elu"])


def test_a_compact_rule_is_quoted_as_written():
    """Errors quote a compact rule in the form the user wrote, not the mapping it becomes."""
    with pytest.raises(PlanError) as e:
        Plan.parse(["all:all:softmax", " 0:1:band(windw=3) "])
    assert str(e.value).startswith("plan rule 1 ('0:1:band(windw=3)'): unknown parameter")


def test_unknown_key_names_the_rule_and_close_match():
    with pytest.raises(PlanError, match=r"rule 0 .*unknown parameter 'epz'.*'eps'"):
        Plan.parse([{"layers": "all", "heads": "all", "mechanism": "linear_elu(epz=1)"}])


def test_bad_rule_shapes():
    with pytest.raises(PlanError, match="missing 'mechanism'"):
        Plan.parse([{"layers": "all"}])
    with pytest.raises(PlanError, match="unknown parameter"):
        Plan.parse([{"layers": "all", "head": "all", "mechanism": "softmax"}])
    with pytest.raises(PlanError, match="LAYERS:HEADS:SPEC"):
        Plan.parse("0:softmax")
    with pytest.raises(PlanError, match="neither a mapping"):
        Plan.parse([3])
    with pytest.raises(PlanError, match="JSON/YAML"):
        Plan.parse("[{layers: all")


def test_out_of_range_index_names_rule_count_and_fix():
    p = Plan.parse(["all:all:softmax", "0:12:linear_elu"])
    with pytest.raises(PlanError) as e:
        p.resolve(num_layers=6, num_heads=12)
    msg = str(e.value)
    assert "rule 1" in msg and "head index 12" in msg and "12 heads" in msg and "0-11" in msg
    with pytest.raises(PlanError, match="layer index 6 .* 6 layers"):
        Plan.parse("6:all:softmax").resolve(6, 12)


def test_mechanisms_listing_and_spec_with_colon_in_string():
    p = Plan.parse(["0:all:linear_elu", "1:all:softmax", "2:all:linear_elu(eps=0.5)"])
    assert p.mechanisms() == ["linear_elu", "softmax"]
    # a colon inside a quoted value does not split the compact form
    with pytest.raises(PlanError, match="must be a number"):
        Plan.parse("all:all:linear_elu(eps='a:b')")


def test_rule_accepts_loose_forms():
    assert Rule("0-2", 1, "linear_elu") == Rule((0, 1, 2), (1,), LINEAR)
    assert Rule("all", [3, 1], "softmax").heads == (1, 3)
    with pytest.raises(PlanError, match="Rule.mechanism: unknown mechanism"):
        Rule("all", "all", "nope")
