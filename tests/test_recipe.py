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
    (dict(margin=-1), "margin"), (dict(margin=-0.5), "margin"), (dict(margin=True), "margin"),
    (dict(margin=float("nan")), "margin"), (dict(margin=float("inf")), "margin"), (dict(margin="1"), "margin"),
    (dict(margin=140), "margin"),  # 448 * 2**-140 is below float32's normal range
    (dict(backward_override="high_precision"), "backward_override"),
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
    (dict(amax_epsilon="0"), "amax_epsilon"), (dict(amax_epsilon=1e39), "amax_epsilon"),
    (dict(amax_epsilon=float("inf")), "amax_epsilon"), (dict(fp8_quant_fwd_inp=(True, 0.0)), "fp8_quant_fwd_inp"),
    (dict(fp8_gemm_fprop=False), "fp8_gemm_fprop"), (dict(backward_override="fp8"), "backward_override"),
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


def test_real_margin_accepted_and_scaled_max_matches_float32_formula():
    # TE passes the margin as a C float and computes fp8_max * powf(2, -margin) in float32; integer margins are exact
    import numpy as np

    for margin in (0, 1, 5, 5.0, 0.5, 2.25, 30.7):
        r = DelayedScaling(margin=margin)
        for fp8_max in (448.0, 57344.0):
            expected = np.float32(np.float32(fp8_max) * np.float32(2.0 ** -float(np.float32(margin))))
            assert r.scaled_max(fp8_max) == float(expected)
    assert DelayedScaling(margin=5).margin == 5 and isinstance(DelayedScaling(margin=5).margin, int)
    assert DelayedScaling(margin=5.0).margin == 5.0
    assert DelayedScaling(margin=3).scaled_max(448.0) == 56.0


def test_predicates_are_class_methods_as_in_te():
    from fp8kit.recipe import Recipe

    for cls in (DelayedScaling, Float8CurrentScaling):
        assert issubclass(cls, Recipe)
        for obj in (cls, cls()):
            assert obj.float8_per_tensor_scaling()
            assert not (obj.mxfp8() or obj.nvfp4() or obj.float8_block_scaling() or obj.custom())
    assert DelayedScaling.delayed() and not DelayedScaling.float8_current_scaling()
    assert Float8CurrentScaling().float8_current_scaling() and not Float8CurrentScaling().delayed()


def test_current_scaling_qparams_default_from_the_shortcuts():
    from fp8kit.recipe import MMParams, QParams

    r = Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=1e-3)
    for role in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert role == QParams(power_2_scale=True, amax_epsilon=1e-3)
    r = Float8CurrentScaling(fp8_quant_bwd_grad=QParams(amax_epsilon=2.0))
    assert r.fp8_quant_fwd_inp == QParams() and r.fp8_quant_bwd_grad.amax_epsilon == 2.0
    assert Float8CurrentScaling() == Float8CurrentScaling(fp8_quant_fwd_inp=QParams())
    assert (r.fp8_gemm_fprop, r.fp8_gemm_dgrad, r.fp8_gemm_wgrad) == (
        MMParams(False), MMParams(True), MMParams(True))
    with pytest.raises(NotImplementedError, match="stochastic_rounding"):
        QParams(stochastic_rounding=True)
    with pytest.raises(ValueError, match="amax_epsilon"):
        QParams(amax_epsilon=-1.0)
