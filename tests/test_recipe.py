import ast
import pathlib

import pytest

from fp8kit.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)


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
def test_equal_by_fields_snapshots_hashable(cls):
    a, b = cls(), cls()
    assert a == b and a.snapshot() == b.snapshot() == a and hash(a.snapshot()) == hash(b.snapshot())
    assert len({a.snapshot(), b.snapshot()}) == 1
    with pytest.raises(TypeError, match="unhashable.*snapshot"):  # mutable, as Transformer Engine's recipes
        hash(a)
    a.fp8_format = Format.E4M3
    assert a != b and a == cls(fp8_format=Format.E4M3)


def test_every_field_distinguishes_delayed_recipes():
    def algo(h):
        return h.max(0).values

    variants = [dict(margin=1), dict(interval=2), dict(fp8_format=Format.E4M3), dict(amax_history_len=16),
                dict(amax_compute_algo="most_recent"), dict(amax_compute_algo=algo),
                dict(scaling_factor_compute_algo=lambda a, s, m, r: s),
                dict(override_linear_precision=(True, False, False)), dict(reduce_amax=False),
                dict(power_2_scale=True)]
    recipes = {DelayedScaling().snapshot()} | {DelayedScaling(**v).snapshot() for v in variants}
    assert len(recipes) == len(variants) + 1


def test_list_override_becomes_tuple_and_hashes():
    r = DelayedScaling(override_linear_precision=[False, True, False])
    assert r.override_linear_precision == (False, True, False)
    hash(r.snapshot())
    r.override_linear_precision = [True, True, False]
    assert r.override_linear_precision == (True, True, False)


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
    names = set()
    files = sorted(pathlib.Path(__file__).parents[1].joinpath("fp8kit", "recipe").glob("*.py"))
    assert len(files) >= 4
    for node in (n for f in files for n in ast.walk(ast.parse(f.read_text()))):
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

    predicates = ["delayed", "float8_current_scaling", "mxfp8", "float8_block_scaling", "nvfp4", "custom"]
    classes = [DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling,
               CustomRecipe]
    for i, cls in enumerate(classes):
        assert issubclass(cls, Recipe)
        instance = cls(qfactory=lambda role: None) if cls is CustomRecipe else cls()

        class Derived(cls):  # a user subclass answers as its base, as issubclass does in Transformer Engine
            pass

        for obj in (cls, instance, instance.snapshot(), Derived):
            assert [getattr(obj, p)() for p in predicates] == [j == i for j in range(6)], (cls, obj)
            assert obj.float8_per_tensor_scaling() == (i < 2)
            assert isinstance(getattr(type(instance), "delayed"), type(Recipe.delayed))  # bound to the class
    assert not any(getattr(Recipe, p)() for p in predicates)


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
    assert QParams(stochastic_rounding=True).stochastic_rounding  # an NVFP4 option: current scaling refuses it
    with pytest.raises(ValueError, match="fp8_quant_bwd_grad.*stochastic_rounding"):
        Float8CurrentScaling(fp8_quant_bwd_grad=QParams(stochastic_rounding=True))
    with pytest.raises(ValueError, match="amax_epsilon"):
        QParams(amax_epsilon=-1.0)


# ---- Transformer Engine's defaults and text (read from transformer_engine/common/recipe/__init__.py, d0067d0) ----

TE_DEFAULTS = {
    DelayedScaling: dict(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max",
                         scaling_factor_compute_algo=None, reduce_amax=True, fp8_dpa=False, fp8_mha=False,
                         backward_override=None),
    Float8CurrentScaling: dict(use_power_2_scales=False, fp8_format=Format.HYBRID,
                               fp8_gemm_fprop=(False,), fp8_gemm_dgrad=(True,), fp8_gemm_wgrad=(True,),
                               fp8_quant_fwd_inp=(False, 0.0, False, False, False),
                               fp8_quant_fwd_weight=(False, 0.0, False, False, False),
                               fp8_quant_bwd_grad=(False, 0.0, False, False, False),
                               fp8_dpa=False, fp8_mha=False, backward_override=None),
}


def _plain(value):
    """MMParams / QParams as tuples of their fields, so that the expectations above need no fp8kit class."""
    import dataclasses

    return dataclasses.astuple(value) if dataclasses.is_dataclass(value) else value


@pytest.mark.parametrize("cls", list(TE_DEFAULTS))
def test_defaults_are_transformer_engines(cls):
    r = cls()
    assert {name: _plain(getattr(r, name)) for name in TE_DEFAULTS[cls]} == TE_DEFAULTS[cls]
    # Transformer Engine's own fields come first, in its order (positional arguments mean the same)
    import dataclasses

    positional = [f.name for f in dataclasses.fields(cls) if not f.kw_only]
    assert positional == [n for n in TE_DEFAULTS[cls] if n in positional]
    assert set(TE_DEFAULTS[cls]) - {"fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"} == \
        set(positional)


def test_repr_is_transformer_engines():
    assert repr(DelayedScaling(margin=2, amax_history_len=16)) == (
        "recipe_type=DelayedScaling, margin=2, format=HYBRID, amax_history_len=16, reduce_amax=True, "
        "fp8_dpa=False, fp8_mha=False, backward_override=None")
    qparams = ("Qparams(\npower_2_scale=False,\namax_epsilon=0.0,\nrandom_hadamard_transform=False,\n"
               "stochastic_rounding=False,\nfp4_2d_quantization=False\n)")
    assert repr(Float8CurrentScaling()) == (
        f"recipe_type=Float8CurrentScaling, format=HYBRID, fp8_quant_fwd_inp={qparams}, "
        f"fp8_quant_fwd_weight={qparams}, fp8_quant_bwd_grad={qparams}, "
        "fp8_gemm_fprop=MMParams(use_split_accumulator=False), fp8_gemm_dgrad=MMParams(use_split_accumulator=True), "
        "fp8_gemm_wgrad=MMParams(use_split_accumulator=True), fp8_dpa=False, fp8_mha=False, backward_override=None")
    # fp8kit's own fields show only when set, so the text stays Transformer Engine's for the recipes it knows
    assert repr(DelayedScaling(interval=2)).endswith("backward_override=None, interval=2")
    r = DelayedScaling()
    text = repr(r)
    r.amax_history_len = 8  # the text follows assignments
    assert repr(r) == text.replace("amax_history_len=1024", "amax_history_len=8")


# ---- mutation ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,name,bad,good", [
    (DelayedScaling, "amax_history_len", 0, 16), (DelayedScaling, "margin", -1, 2.5),
    (DelayedScaling, "amax_compute_algo", "mean", "most_recent"), (DelayedScaling, "reduce_amax", 0, False),
    (DelayedScaling, "fp8_format", Format.E2M1, Format.E4M3), (DelayedScaling, "interval", 0, 3),
    (DelayedScaling, "override_linear_precision", (True,), (True, False, False)),
    (Float8CurrentScaling, "amax_epsilon", float("nan"), 1e-3),
    (Float8CurrentScaling, "backward_override", "fp8", "high_precision"),
    (Float8CurrentScaling, "fp8_gemm_fprop", True, None),
])
def test_assignment_is_validated_as_construction_is(cls, name, bad, good):
    from fp8kit.recipe import MMParams

    good = MMParams(True) if name == "fp8_gemm_fprop" else good
    r = cls()
    before = r.snapshot()
    with pytest.raises(ValueError, match=name):
        setattr(r, name, bad)
    assert r == before and r.snapshot() is before  # a refused assignment leaves the recipe as it was
    setattr(r, name, good)
    assert getattr(r, name) == good and r.snapshot() is not before and r.snapshot() == r != before
    assert getattr(before, name) != good  # the earlier snapshot keeps the old value


def test_unknown_attribute_and_snapshot_assignment_raise():
    r = DelayedScaling()
    with pytest.raises(AttributeError, match="amax_histroy_len.*amax_history_len"):
        r.amax_histroy_len = 16  # a typo is not silently kept (unlike Transformer Engine)
    with pytest.raises(AttributeError, match="read-only snapshot"):
        r.snapshot().margin = 1
    assert r.snapshot().snapshot() is r.snapshot()


def test_derived_qparams_follow_their_fields_until_assigned():
    from fp8kit.recipe import QParams

    r = Float8CurrentScaling()
    r.use_power_2_scales = True
    r.amax_epsilon = 0.5
    assert r.fp8_quant_fwd_inp == r.fp8_quant_bwd_grad == QParams(power_2_scale=True, amax_epsilon=0.5)
    r.fp8_quant_bwd_grad = QParams(amax_epsilon=2.0)  # assigned: kept as assigned
    r.use_power_2_scales = False
    assert r.fp8_quant_fwd_inp == QParams(amax_epsilon=0.5) and r.fp8_quant_bwd_grad == QParams(amax_epsilon=2.0)
    r.fp8_quant_bwd_grad = None  # None: derived again
    assert r.fp8_quant_bwd_grad == QParams(amax_epsilon=0.5)


def test_copies_keep_fields_and_stay_mutable():
    import copy
    import dataclasses
    import pickle

    r = DelayedScaling(amax_history_len=16, margin=1)
    r.reduce_amax = False
    for c in (copy.deepcopy(r), pickle.loads(pickle.dumps(r)), copy.copy(r)):
        assert c == r and c is not r
        c.amax_history_len = 8
        assert r.amax_history_len == 16 and c.snapshot().amax_history_len == 8
    snap = pickle.loads(pickle.dumps(r.snapshot()))
    assert snap == r.snapshot() and hash(snap) == hash(r.snapshot())
    with pytest.raises(AttributeError):
        snap.margin = 0
    replaced = dataclasses.replace(r.snapshot(), reduce_amax=True)  # a new, mutable recipe
    assert replaced.reduce_amax and replaced.amax_history_len == 16
    replaced.margin = 3


def test_equal_recipes_share_one_snapshot_object():
    """Registry keys then also match by identity, which torch.compile relies on when it looks up keys while tracing
    (tests/test_recipe_mutation.py::test_compiled_function_recompiles_for_an_assigned_recipe)."""
    a, b = DelayedScaling(amax_history_len=16), DelayedScaling()
    assert a.snapshot() is not b.snapshot()
    b.amax_history_len = 16
    assert a.snapshot() is b.snapshot()
    assert Float8CurrentScaling().snapshot() is Float8CurrentScaling().snapshot()
