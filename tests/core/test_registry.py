"""Registry, spec parsing and config validation."""

import pytest

import attnlab
from attnlab.core import Registry, RegistryError, parse_spec, resolve_config


def test_parse_spec_forms():
    assert parse_spec("softmax") == ("softmax", {})
    assert parse_spec("band(window=4)") == ("band", {"window": 4})
    assert parse_spec(" x(a=1.5, b=[0, 3], c='fixed', d=True) ") == (
        "x", {"a": 1.5, "b": [0, 3], "c": "fixed", "d": True}
    )


@pytest.mark.parametrize("bad", ["band(4)", "band(window=)", "band(window=foo)", "1+2",
                                 "band(**x)"])
def test_parse_spec_errors_are_clear(bad):
    with pytest.raises(RegistryError) as e:
        parse_spec(bad)
    assert "spec" in str(e.value)


def test_unknown_mechanism_names_close_matches():
    with pytest.raises(RegistryError, match=r"unknown mechanism 'softmx'.*'softmax'"):
        attnlab.build_mechanism("softmx", attnlab.HeadDims(2, 8))
    with pytest.raises(RegistryError, match=r"unknown mechanism 'BAND'.*did you mean 'band'"):
        attnlab.build_mechanism("BAND(window=2)", attnlab.HeadDims(2, 8))


def test_unknown_key_names_close_matches():
    name = "band" if "band" in attnlab.list_mechanisms() else None
    if name is None:
        pytest.skip("band not registered")
    with pytest.raises(RegistryError, match=r"unknown parameter 'windw'.*'window'"):
        resolve_config("band(windw=3)")


def test_wrong_value_type_is_an_error():
    if "band" not in attnlab.list_mechanisms():
        pytest.skip("band not registered")
    with pytest.raises(RegistryError, match="integer"):
        resolve_config("band(window=2.5)")
    with pytest.raises(RegistryError, match="integer"):
        resolve_config("band(window=True)")


def test_mapping_and_config_forms_agree():
    cfg = resolve_config("softmax")
    assert resolve_config({"name": "softmax"}) == cfg
    assert resolve_config(cfg) is cfg
    with pytest.raises(RegistryError, match="'name'"):
        resolve_config({"window": 3})


def test_generic_registry():
    reg: Registry[int] = Registry("thing")
    reg.register("alpha", 1)
    assert reg.get("alpha") == 1 and "alpha" in reg and len(reg) == 1
    with pytest.raises(RegistryError, match="'alpha'"):
        reg.get("alpah")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("alpha", 2)
    with pytest.raises(ValueError, match="snake case"):
        reg.register("Alpha", 3)


def test_wrong_rank_is_a_clear_error():
    import torch

    mech = attnlab.build_mechanism("softmax", attnlab.HeadDims(2, 8))
    q = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="4-D"):
        mech(q, q, q, attnlab.AttnContext())


def test_list_mechanisms_sorted_and_public_api():
    names = attnlab.list_mechanisms()
    assert names == sorted(names) and "softmax" in names
    assert attnlab.AttnContext().layer_idx == 0
