"""Presets: the official JAT head rule and a plan that parses."""

from __future__ import annotations

import pytest

from attnlab.core import RegistryError, resolve_config
from attnlab.hf.plan import Plan
from attnlab.presets import bert_jat, jat_heads_of


def test_jat_head_rule_is_the_official_one():
    assert jat_heads_of(6, 12) == [0, 2, 4, 6, 8, 10]  # at most half: even heads
    assert jat_heads_of(3, 12) == [0, 2, 4]
    assert jat_heads_of(7, 12) == [0, 1, 2, 3, 4, 5, 6]  # more than half: the first ones
    assert jat_heads_of(12, 12) == list(range(12))
    assert jat_heads_of(2, 4) == [0, 2]
    with pytest.raises(ValueError, match="jat_heads"):
        jat_heads_of(13, 12)


def test_bert_jat_rules_parse_and_carry_the_config():
    rules = bert_jat(rho=3, coef=0.25)
    assert rules[0]["layers"] == [1, 2, 3, 8, 9, 10]
    assert rules[0]["heads"] == [0, 2, 4, 6, 8, 10]
    cfg = resolve_config(rules[0]["mechanism"])
    assert (cfg.name, cfg.rho, cfg.coef) == ("jat", 3.0, 0.25)
    Plan.parse(rules)  # a valid plan
    with pytest.raises(RegistryError, match="rho"):
        bert_jat(rhoo=3)
