"""The block-scaled and custom recipe classes (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling,
CustomRecipe): Transformer Engine's fields, defaults, validation and text, and their refusal by autocast until their
quantizers exist. The expected defaults below were read from transformer_engine/common/recipe/__init__.py (TE commit
d0067d0), with TE's environment variables unset."""

import dataclasses

import pytest

from fp8kit.recipe import (
    CustomRecipe,
    Float8BlockScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
)

QP = ("power_2_scale", "amax_epsilon", "random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization")
TE_DEFAULTS = {
    MXFP8BlockScaling: dict(margin=0, fp8_format=Format.E4M3, fp8_dpa=False, fp8_mha=False, backward_override=None,
                            enable_2d_quantization=False),
    Float8BlockScaling: dict(use_f32_scales=False, fp8_format=Format.E4M3, x_block_scaling_dim=1,
                             w_block_scaling_dim=2, grad_block_scaling_dim=1, fp8_gemm_fprop=(True,),
                             fp8_gemm_dgrad=(True,), fp8_gemm_wgrad=(True,), fp8_dpa=False, fp8_mha=False,
                             backward_override=None,
                             fp8_quant_fwd_inp=(True, 0.0, False, False, False),
                             fp8_quant_fwd_weight=(True, 0.0, False, False, False),
                             fp8_quant_bwd_grad=(True, 0.0, False, False, False)),
    NVFP4BlockScaling: dict(disable_rht=False, disable_stochastic_rounding=False, disable_2d_quantization=False,
                            row_scaled_activation=False, nvfp4_4over6="none", nvfp4_4over6_e4m3_use_256="all",
                            nvfp4_4over6_err_mode="MAE", fp4_format=Format.E2M1, fp8_format=Format.E4M3,
                            fp8_dpa=False, fp8_mha=False, backward_override=None,
                            fp4_quant_fwd_inp=(False, 0.0, True, False, False),
                            fp4_quant_fwd_weight=(False, 0.0, False, False, True),
                            fp4_quant_bwd_grad=(False, 0.0, True, True, False)),
    CustomRecipe: dict(fp8_format=Format.HYBRID, fp8_dpa=False, fp8_mha=False, backward_override=None,
                       quantization_alignment=128),
}
DERIVED = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad", "fp4_quant_fwd_inp",
           "fp4_quant_fwd_weight", "fp4_quant_bwd_grad")


def factory(role):
    return None


def make(cls, **kwargs):
    return cls(qfactory=factory, **kwargs) if cls is CustomRecipe else cls(**kwargs)


def plain(value):
    return dataclasses.astuple(value) if dataclasses.is_dataclass(value) else value


@pytest.mark.parametrize("cls", list(TE_DEFAULTS))
def test_defaults_and_field_order_are_transformer_engines(cls):
    r = make(cls)
    assert {n: plain(getattr(r, n)) for n in TE_DEFAULTS[cls]} == TE_DEFAULTS[cls]
    positional = [f.name for f in dataclasses.fields(cls) if not f.kw_only]
    expected = [n for n in TE_DEFAULTS[cls] if n not in DERIVED]
    assert positional == (["qfactory"] + expected if cls is CustomRecipe else expected)


def test_format_e2m1():
    assert (Format.E2M1.value.max_fwd, Format.E2M1.value.max_bwd) == (6, 6)
    assert [f.name for f in Format] == ["E2M1", "E4M3", "E5M2", "HYBRID"]  # Transformer Engine's order


@pytest.mark.parametrize("cls,kwargs,field", [
    (MXFP8BlockScaling, dict(fp8_format=Format.E5M2), "fp8_format"),
    (MXFP8BlockScaling, dict(margin=-1), "margin"), (MXFP8BlockScaling, dict(margin=0.5), "margin"),
    (MXFP8BlockScaling, dict(enable_2d_quantization=1), "enable_2d_quantization"),
    (MXFP8BlockScaling, dict(backward_override="fp8"), "backward_override"),
    (Float8BlockScaling, dict(x_block_scaling_dim=3), "x_block_scaling_dim"),
    (Float8BlockScaling, dict(grad_block_scaling_dim=True), "grad_block_scaling_dim"),
    (Float8BlockScaling, dict(x_block_scaling_dim=2), "w_block_scaling_dim"),  # 2D x 2D (weight is 2D by default)
    (Float8BlockScaling, dict(w_block_scaling_dim=1, x_block_scaling_dim=2, grad_block_scaling_dim=2),
     "grad_block_scaling_dim"),
    (Float8BlockScaling, dict(fp8_gemm_dgrad=MMParams(False)), "fp8_gemm_dgrad"),
    (Float8BlockScaling, dict(fp8_gemm_wgrad=True), "fp8_gemm_wgrad"),
    (Float8BlockScaling, dict(fp8_dpa=True), "fp8_dpa"),
    (Float8BlockScaling, dict(fp8_format=Format.E5M2), "fp8_format"),
    (Float8BlockScaling, dict(fp8_quant_fwd_inp=QParams(stochastic_rounding=True)), "fp8_quant_fwd_inp"),
    (Float8BlockScaling, dict(use_f32_scales="yes"), "use_f32_scales"),
    (NVFP4BlockScaling, dict(fp4_format=Format.E4M3), "fp4_format"),
    (NVFP4BlockScaling, dict(fp8_format=Format.HYBRID), "fp8_format"),
    (NVFP4BlockScaling, dict(disable_rht=None), "disable_rht"),
    (NVFP4BlockScaling, dict(nvfp4_4over6="some"), "nvfp4_4over6"),
    (NVFP4BlockScaling, dict(nvfp4_4over6_err_mode="mae"), "nvfp4_4over6_err_mode"),
    (NVFP4BlockScaling, dict(fp4_quant_fwd_inp=QParams(power_2_scale=True)), "fp4_quant_fwd_inp"),
    (NVFP4BlockScaling, dict(fp4_quant_bwd_grad=(True,)), "fp4_quant_bwd_grad"),
    (CustomRecipe, dict(quantization_alignment=0), "quantization_alignment"),
    (CustomRecipe, dict(fp8_format="E4M3"), "fp8_format"),
])
def test_bad_values_name_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make(cls, **kwargs)
    r = make(cls)
    name, value = next(iter(kwargs.items()))
    if len(kwargs) == 1:  # the same check on assignment, leaving the recipe unchanged
        with pytest.raises(ValueError, match=field):
            setattr(r, name, value)
        assert r == make(cls)


def test_custom_recipe_needs_a_callable_factory():
    with pytest.raises(TypeError, match="qfactory"):
        CustomRecipe()
    with pytest.raises(ValueError, match="qfactory"):
        CustomRecipe(qfactory=3)
    r = CustomRecipe(qfactory=factory, quantization_alignment=32)
    assert r.qfactory is factory and r.custom() and repr(r) == (
        f"recipe_type=CustomRecipe, qfactory={factory}, backward_override=None, quantization_alignment=32")


@pytest.mark.parametrize("field,value", [("nvfp4_4over6", "weights"), ("nvfp4_4over6", "all"),
                                         ("nvfp4_4over6_e4m3_use_256", "none"), ("nvfp4_4over6_err_mode", "MSE")])
def test_nvfp4_4over6_options_not_implemented(field, value):
    # constructed and assigned as in Transformer Engine (its tests build such a recipe at import) ...
    r = NVFP4BlockScaling(**{field: value})
    assert getattr(r, field) == value and r.unsupported_4over6() == f"{field}={value!r}"
    default = NVFP4BlockScaling()
    assert default.unsupported_4over6() is None
    setattr(default, field, value)
    assert default.unsupported_4over6() == f"{field}={value!r}"
    # ... and refused, naming the field, by the first FP8 forward
    import torch

    import fp8kit.pytorch as te
    layer = te.Linear(32, 32)
    with pytest.raises(NotImplementedError, match=field):
        with te.autocast(recipe=r):
            layer(torch.randn(32, 32))


def test_float8_block_split_accumulator_and_one_2d_operand():
    assert Float8BlockScaling(w_block_scaling_dim=1, x_block_scaling_dim=2).x_block_scaling_dim == 2
    r = Float8BlockScaling()
    with pytest.raises(ValueError, match="2D"):
        r.grad_block_scaling_dim = 2
    r.w_block_scaling_dim = 1
    r.grad_block_scaling_dim = 2
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 1, 2)


def test_float8_block_qparams_follow_use_f32_scales():
    # unlike Transformer Engine (whose QParams follow NVTE_FP8_BLOCK_SCALING_FP32_SCALES at import), the argument
    # takes effect
    r = Float8BlockScaling(use_f32_scales=True)
    assert r.fp8_quant_fwd_inp == r.fp8_quant_fwd_weight == r.fp8_quant_bwd_grad == QParams(power_2_scale=False)
    r.fp8_quant_bwd_grad = QParams(power_2_scale=True, amax_epsilon=1e-6)
    r.use_f32_scales = False
    assert r.fp8_quant_fwd_inp == QParams(power_2_scale=True)
    assert r.fp8_quant_bwd_grad == QParams(power_2_scale=True, amax_epsilon=1e-6)


def test_nvfp4_qparams_follow_the_flags_and_can_be_assigned():
    r = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    assert r.fp4_quant_fwd_inp == r.fp4_quant_fwd_weight == r.fp4_quant_bwd_grad == QParams()
    r.disable_rht = False
    assert r.fp4_quant_fwd_inp == QParams(random_hadamard_transform=True)
    assert r.fp4_quant_bwd_grad == QParams(random_hadamard_transform=True)
    # as TE's tests do: assign the QParams directly (kept until set back to None)
    r.fp4_quant_fwd_weight = QParams(fp4_2d_quantization=True, random_hadamard_transform=True)
    r.disable_2d_quantization = False
    assert r.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True, random_hadamard_transform=True)
    r.row_scaled_activation = True
    assert r.snapshot().row_scaled_activation and r.snapshot() == r


@pytest.mark.parametrize("cls", list(TE_DEFAULTS))
def test_snapshot_hash_and_equality(cls):
    a, b = make(cls), make(cls)
    assert a == b and hash(a.snapshot()) == hash(b.snapshot())
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)
    a.backward_override = "dequantized"
    assert a != b and a.snapshot() != b.snapshot() and a.snapshot().backward_override == "dequantized"


def test_repr_is_transformer_engines():
    assert repr(MXFP8BlockScaling()) == ("recipe_type=MXFP8BlockScaling, margin=0, format=E4M3, "
                                         "backward_override=None, enable_2d_quantization=False")
    text = repr(NVFP4BlockScaling(disable_rht=True))
    assert text.startswith("recipe_type=NVFP4BlockScaling, fp4_format=E2M1, fp8_format=E4M3, fp8_dpa=False, "
                           "fp8_mha=False, backward_override=None, row_scaled_activation=False, nvfp4_4over6=none, "
                           "nvfp4_4over6_e4m3_use_256=all, nvfp4_4over6_err_mode=MAE, fp4_quant_fwd_inp=Qparams(\n")
    assert text.endswith("stochastic_rounding=True,\nfp4_2d_quantization=False\n), ")  # TE's trailing ", "
    block = repr(Float8BlockScaling())
    order = ["format=E4M3", "fp8_quant_fwd_inp=", "fp8_quant_bwd_grad=", "x_block_scaling_dim=1",
             "grad_block_scaling_dim=1", "fp8_gemm_fprop=MMParams(use_split_accumulator=True)",
             "fp8_mha=False", "backward_override=None"]
    assert [block.index(p) for p in order] == sorted(block.index(p) for p in order)


@pytest.mark.parametrize("cls", list(TE_DEFAULTS))
def test_autocast_refuses_them_naming_the_recipe(cls):
    torch = pytest.importorskip("torch")
    import fp8kit.pytorch as te

    recipe = make(cls)
    layer = te.Linear(32, 32)
    # those run: tests/test_block_linear.py, tests/test_nvfp4_linear.py, tests/test_custom_recipe_autocast.py
    # and their quantized weights: tests/test_block_weights.py
    if cls.__name__ not in ("MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"):
        with pytest.raises(NotImplementedError, match=cls.__name__):
            with te.autocast(recipe=recipe):
                layer(torch.randn(4, 32))
    if cls.__name__ not in ("MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling"):
        with pytest.raises(NotImplementedError, match=cls.__name__):
            with te.quantized_model_init(recipe=recipe):
                pass
    with te.autocast(recipe=None):  # the stack is intact afterwards
        layer(torch.randn(4, 32))


def test_quantizer_role_and_requests_as_in_transformer_engine():
    pytest.importorskip("torch")
    import fp8kit.pytorch as te

    role = te.QuantizerRole(module_type="linear", tensor_type="weight", name="fc1")
    assert str(role) == "module_type=linear|tensor_type=weight|name=fc1"
    assert str(te.QuantizerRole()) == "QuantizerRole()"
    assert str(te.QuantizerRole(tensor_type="input")) == "tensor_type=input"
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen in Transformer Engine too
        role.name = "fc2"
    with pytest.raises(ValueError, match="name"):
        te.QuantizerRole(name=3)
    request = te.DelayedScalingRequest(amax_history_len=16)
    assert isinstance(request, te.QuantizerRequest)
    assert hash(request) == hash(te.DelayedScalingRequest(amax_history_len=16))
    # Transformer Engine's defaults
    assert dataclasses.astuple(te.DelayedScalingRequest()) == (Format.HYBRID, 0, 1024, "max", None, True)
    for bad, field in ((dict(amax_history_len=0), "amax_history_len"), (dict(margin=-1), "margin"),
                       (dict(amax_compute_algo="mean"), "amax_compute_algo"), (dict(reduce_amax=1), "reduce_amax")):
        with pytest.raises(ValueError, match=field):
            te.DelayedScalingRequest(**bad)


def test_nvfp4_row_scaled_activation_implemented_by_pytorch_only():
    r = NVFP4BlockScaling(row_scaled_activation=True)
    r.check_implemented(row_scaled=True)  # fp8kit.pytorch (tests/test_nvfp4_row_scaled.py)
    with pytest.raises(NotImplementedError, match="row_scaled_activation=True.*fp8kit.jax"):
        r.check_implemented()
