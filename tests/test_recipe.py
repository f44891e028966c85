import ast
import pathlib

import pytest

from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format


def test_format_maxima_and_names():
    assert Format.E4M3.value.max_fwd == 448 and Format.E4M3.value.max_bwd == 448
    assert Format.E5M2.value.max_fwd == 57344 and Format.E5M2.value.max_bwd == 57344
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344
    assert (Format.HYBRID.value.fwd, Format.HYBRID.value.bwd) == ("e4m3", "e5m2")


def test_delayed_defaults():
    r = DelayedScaling()
    assert (r.margin, r.interval, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (
        0, 1, Format.HYBRID, 1024, "max")
    assert r.scaling_factor_compute_algo is None
    assert r.override_linear_precision == (False, False, False)
    assert r.reduce_amax is True and r.power_2_scale is False
    assert r.fp8_dpa is False and r.fp8_mha is False
    assert r.delayed() and not r.float8_current_scaling()


def test_current_defaults():
    r = Float8CurrentScaling()
    assert r.fp8_format == Format.HYBRID and r.use_power_2_scales is False and r.amax_epsilon == 0.0
    assert r.float8_current_scaling() and not r.delayed()
    r = Float8CurrentScaling(fp8_format=Format.E5M2, use_power_2_scales=True, amax_epsilon=1e-3)
    assert (r.fp8_format, r.use_power_2_scales, r.amax_epsilon) == (Format.E5M2, True, 1e-3)


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_immutable_hashable_equal(cls):
    a, b = cls(), cls()
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    with pytest.raises(Exception):
        a.fp8_format = Format.E4M3
    c = cls(fp8_format=Format.E4M3)
    assert c != a


def test_every_field_distinguishes_delayed_recipes():
    def algo(h):
        return h.max(0).values

    variants = [dict(margin=1), dict(interval=2), dict(fp8_format=Format.E4M3), dict(amax_history_len=16),
                dict(amax_compute_algo="most_recent"), dict(amax_compute_algo=algo),
                dict(scaling_factor_compute_algo=lambda a, s, m, r: s),
                dict(override_linear_precision=(True, False, False)), dict(reduce_amax=False),
                dict(power_2_scale=True)]
    recipes = {DelayedScaling()} | {DelayedScaling(**v) for v in variants}
    assert len(recipes) == len(variants) + 1


def test_list_override_becomes_tuple_and_hashes():
    r = DelayedScaling(override_linear_precision=[False, True, False])
    assert r.override_linear_precision == (False, True, False)
    hash(r)


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_unknown_keyword_is_type_error(cls):
    with pytest.raises(TypeError, match="amax_histroy_len"):
        cls(amax_histroy_len=16)


@pytest.mark.parametrize("kwargs,field", [
    (dict(margin=-1), "margin"), (dict(margin=0.5), "margin"), (dict(margin=True), "margin"),
    (dict(interval=0), "interval"), (dict(interval=1.0), "interval"),
    (dict(fp8_format="E4M3"), "fp8_format"),
    (dict(amax_history_len=0), "amax_history_len"), (dict(amax_history_len=2.5), "amax_history_len"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"),
    (dict(scaling_factor_compute_algo=3), "scaling_factor_compute_algo"),
    (dict(override_linear_precision=(True, False)), "override_linear_precision"),
    (dict(override_linear_precision=(1, 0, 0)), "override_linear_precision"),
    (dict(reduce_amax=1), "reduce_amax"), (dict(power_2_scale="yes"), "power_2_scale"),
    (dict(fp8_dpa=1), "fp8_dpa"),
])
def test_delayed_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DelayedScaling(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(fp8_format=None), "fp8_format"), (dict(use_power_2_scales=0), "use_power_2_scales"),
    (dict(amax_epsilon=-1.0), "amax_epsilon"), (dict(amax_epsilon=float("nan")), "amax_epsilon"),
    (dict(amax_epsilon="0"), "amax_epsilon"),
])
def test_current_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Float8CurrentScaling(**kwargs)


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
@pytest.mark.parametrize("field", ["fp8_dpa", "fp8_mha"])
def test_attention_flags_not_implemented(cls, field):
    cls(**{field: False})
    with pytest.raises(NotImplementedError, match=field):
        cls(**{field: True})


def test_pure_e5m2_accepted():
    assert DelayedScaling(fp8_format=Format.E5M2).fp8_format is Format.E5M2
    assert Float8CurrentScaling(fp8_format=Format.E5M2).fp8_format is Format.E5M2


def test_recipe_module_imports_no_framework():
    src = pathlib.Path(__file__).parents[1].joinpath("fp8kit", "recipe.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"torch", "jax", "flax", "numpy"}
