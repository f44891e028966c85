"""Our port of Transformer Engine's tests/pytorch/test_sanity.py: the modules run forward and backward under each
per-tensor recipe, dtype and option, with a few cases spread over TE's parameter product (not the full product).

TE's file only checks that the calls run; here each case is also compared with the same module run in high precision
(torch, float64), within the error an FP8 cast allows, and the gradients' dtypes and shapes are checked."""

import copy

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.tensor.utils import replace_raw_data
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref

RECIPES = {"none": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling()}
# (seq, batch, hidden): TE's "small" and an FP8-aligned version of its "weird" config
CONFIGS = {"small": (32, 2, 64), "odd": (16, 3, 48)}


def _close_to_high_precision(out, ref_out, fp8: bool, dtype):
    """FP8 (E4M3 inputs and weights) keeps ~3 significant bits per operand; bf16/fp16 outputs add their rounding."""
    tol = 0.15 if fp8 else (2e-2 if dtype != torch.float32 else 1e-5)
    err = (out.double() - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-6)
    assert err < tol, f"relative error {float(err):.3g} over {tol}"


def _run_sanity(block, dtype, config, recipe_name, skip_wgrad, skip_dgrad, microbatching, backward_override=None):
    seq, batch, hidden = config
    recipe = copy.deepcopy(RECIPES[recipe_name])
    if recipe is not None:
        recipe.backward_override = backward_override
    x = torch.randn(seq, batch, hidden, dtype=dtype, requires_grad=not skip_dgrad)
    if skip_wgrad:
        for p in block.parameters():
            p.requires_grad_(False)
    reference = copy.deepcopy(block).double()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        if microbatching:
            block(x, is_first_microbatch=True)
            out = block(x, is_first_microbatch=False)
        else:
            out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == dtype and out.shape[:2] == (seq, batch)
    ref_out = reference(x.detach().double())
    ref_out = ref_out[0] if isinstance(ref_out, tuple) else ref_out
    _close_to_high_precision(out, ref_out, recipe is not None, dtype)
    if skip_wgrad and skip_dgrad:
        return
    out.sum().backward()
    if not skip_dgrad:
        assert x.grad is not None and x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    for name, p in block.named_parameters():
        if not skip_wgrad:
            assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.shape == p.shape, name


# dtype, recipe, backward_override, config, skip_wgrad, skip_dgrad, microbatching: pairwise-spread cases
LINEAR_CASES = [
    (torch.float32, "none", None, "small", False, False, False),
    (torch.float32, "delayed", None, "odd", True, False, True),
    (torch.bfloat16, "current", "high_precision", "small", False, True, True),
    (torch.float16, "current", "dequantized", "small", False, False, False),
    (torch.bfloat16, "delayed", None, "odd", False, False, True),
    (torch.float32, "current", "dequantized", "odd", True, False, False),
]


@pytest.mark.parametrize("dtype,recipe,override,config,skip_wgrad,skip_dgrad,micro", LINEAR_CASES)
def test_sanity_linear(dtype, recipe, override, config, skip_wgrad, skip_dgrad, micro):
    hidden = CONFIGS[config][2]
    block = te.Linear(hidden, hidden, params_dtype=dtype)
    _run_sanity(block, dtype, CONFIGS[config], recipe, skip_wgrad, skip_dgrad, micro, override)


@pytest.mark.parametrize("dtype,recipe,override,config,skip_wgrad,skip_dgrad,micro", LINEAR_CASES[:4])
@pytest.mark.parametrize("normalization,zero_centered_gamma", [("LayerNorm", True), ("RMSNorm", False)])
def test_sanity_layernorm_linear(dtype, recipe, override, config, skip_wgrad, skip_dgrad, micro, normalization,
                                 zero_centered_gamma):
    hidden = CONFIGS[config][2]
    block = te.LayerNormLinear(hidden, hidden * 3, normalization=normalization,
                               zero_centered_gamma=zero_centered_gamma, params_dtype=dtype)
    _run_sanity(block, dtype, CONFIGS[config], recipe, skip_wgrad, skip_dgrad, micro, override)


@pytest.mark.parametrize("dtype,recipe,activation,normalization", [
    (torch.float32, "delayed", "gelu", "LayerNorm"),
    (torch.bfloat16, "current", "swiglu", "RMSNorm"),
    (torch.float32, "none", "relu", "RMSNorm"),
])
def test_sanity_layernorm_mlp(dtype, recipe, activation, normalization):
    hidden = CONFIGS["small"][2]
    block = te.LayerNormMLP(hidden, 4 * hidden, activation=activation, normalization=normalization,
                            params_dtype=dtype)
    _run_sanity(block, dtype, CONFIGS["small"], recipe, False, False, True)


@pytest.mark.parametrize("dtype,recipe,normalization,fuse_qkv", [
    (torch.float32, "delayed", "LayerNorm", False),
    (torch.bfloat16, "current", "RMSNorm", True),
])
def test_sanity_gpt_layer(dtype, recipe, normalization, fuse_qkv):
    seq, batch, hidden = CONFIGS["small"]
    block = te.TransformerLayer(hidden, 4 * hidden, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                normalization=normalization, fuse_qkv_params=fuse_qkv, params_dtype=dtype)
    _run_sanity(block, dtype, CONFIGS["small"], recipe, False, False, False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module", [te.LayerNorm, te.RMSNorm])
def test_sanity_normalization_amp(dtype, module):
    # under torch.autocast a float32 norm returns the autocast dtype; its gradients stay float32
    block = module(48)
    x = torch.randn(16, 2, 48, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=dtype):
        y = block(x)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in block.parameters())


@pytest.mark.parametrize("recipe,fp8_weights,bias", [("delayed", True, True), ("current", False, False),
                                                     ("none", False, True)])
def test_sanity_linear_with_zero_tokens(recipe, fp8_weights, bias):
    with te.quantized_model_init(enabled=fp8_weights, recipe=RECIPES[recipe]):
        block = te.Linear(64, 256, bias=bias)
    x = torch.randn(0, 64, requires_grad=True)
    with te.autocast(enabled=RECIPES[recipe] is not None, recipe=RECIPES[recipe]):
        y = block(x)
    assert y.shape == (0, 256)
    y.sum().backward()
    assert x.grad.shape == (0, 64)
    if not fp8_weights:
        assert torch.count_nonzero(block.weight.grad) == 0


def test_model_multiple_cast():
    m = te.Linear(16, 32)
    assert m(torch.zeros(16, 16)).dtype == torch.float32
    m.half()
    assert m(torch.zeros(16, 16, dtype=torch.float16)).dtype == torch.float16


def test_replace_raw_data_for_float8tensor():
    q = te.Float8CurrentScalingQuantizer(fp8_dtype=te.DType.kFloat8E4M3, device="cpu")
    t = q.make_empty([32, 32], dtype=torch.bfloat16, device="cpu")
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    q.update_quantized(x, t)
    expected, _ = ref.current_cast(x.float().numpy(), "e4m3")
    np.testing.assert_array_equal(t._data.numpy(), expected)
    kept = {a: getattr(t, a) for a in ("_quantizer", "_fp8_dtype", "_scale_inv", "_transpose", "_transpose_invalid")}
    old, new = t._data, torch.empty_like(t._data)
    replace_raw_data(t, new)
    assert t._data.data_ptr() == new.data_ptr() != old.data_ptr()
    np.testing.assert_array_equal(t._data.numpy(), expected)
    assert all(getattr(t, a) is v for a, v in kept.items())


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_inference_mode_weights_have_no_transpose(module, recipe):
    with torch.no_grad(), te.quantized_model_init(recipe=RECIPES[recipe]):
        block = (te.GroupedLinear(1, 32, 32) if module == "GroupedLinear" else getattr(te, module)(32, 32))
    kwargs = {"m_splits": [32]} if module == "GroupedLinear" else {}
    with torch.inference_mode(), te.autocast(recipe=RECIPES[recipe]):
        y = block(torch.randn(32, 32), **kwargs)
    assert torch.isfinite(y).all()
    fp8 = [p for p in block.parameters() if isinstance(p, te.Float8Tensor)]
    assert fp8 and all(p._data is not None and p._transpose is None for p in fp8)
