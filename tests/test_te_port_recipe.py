"""Our port of Transformer Engine's tests/pytorch/test_recipe.py for the per-tensor recipes: the delayed-scaling
update of a Linear's amax histories and scales (checked in NumPy float32), the scale rule's special amaxes, a recipe
changed between steps, and the quantizer-update warning."""

import warnings

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.quantization import FP8GlobalStateManager
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

import reference as ref


def _expected_scale(history: np.ndarray, algo: str, fp8_max: float, margin: int) -> np.ndarray:
    amax = history.max(axis=0) if algo == "max" else history[0]
    return np.array([ref.clamp_scale(ref.scaled_max(fp8_max, margin) / np.float32(a)) for a in amax], np.float32)


@pytest.mark.parametrize("history_len,algo,first_microbatch", [(31, "max", None), (1024, "most_recent", True),
                                                                (31, "most_recent", False)])
def test_fp8_scale_update_with_linear_module(history_len, algo, first_microbatch, margin=2):
    recipe = DelayedScaling(margin=margin, fp8_format=Format.HYBRID, amax_history_len=history_len,
                            amax_compute_algo=algo)
    with te.autocast(recipe=recipe):
        module = te.Linear(16, 16)
        y = module(torch.randn(16, 16), is_first_microbatch=True)
    y.backward(torch.zeros_like(y))
    fwd = module.fp8_meta[FP8GlobalStateManager.get_meta_tensor_key(forward=True)]
    bwd = module.fp8_meta[FP8GlobalStateManager.get_meta_tensor_key(forward=False)]
    # plant known histories (row 0, the staging row, empty) and scales
    torch.manual_seed(3)
    fwd.amax_history.copy_(2 * torch.rand_like(fwd.amax_history) + 0.5)
    fwd.amax_history[0].zero_()
    bwd.amax_history[0].zero_()
    h_fwd, h_bwd = fwd.amax_history.numpy().copy(), bwd.amax_history.numpy().copy()
    x, dy = torch.randn(16, 16), torch.randn(16, 16)
    with te.autocast(recipe=recipe):
        y = module(x, is_first_microbatch=first_microbatch)
    y.backward(dy)
    # the update runs at the end of the step: the staged amaxes (row 0) move to the last row, the others roll up
    # one row and row 0 is cleared; the scale comes from the updated history (max over it, or its last row)
    for meta, planted, fp8_max, current in ((fwd, h_fwd, Format.HYBRID.value.max_fwd, x),
                                            (bwd, h_bwd, Format.HYBRID.value.max_bwd, dy)):
        hist = meta.amax_history.numpy()
        np.testing.assert_array_equal(hist[:-1, 0], np.concatenate([[0.0], np.roll(planted[:, 0], -1)[1:-1]]))
        assert hist[-1, 0] == ref.amax(current.numpy())
        amax = hist.max(axis=0) if algo == "max" else hist[-1]
        with np.errstate(divide="ignore", over="ignore"):
            expected = [ref.clamp_scale(ref.scaled_max(fp8_max, margin) / a) for a in amax]
        assert float(meta.scale[0]) == expected[0]
        if meta is fwd and (first_microbatch is None or first_microbatch):  # the weight's amax was taken
            assert hist[-1, 1] == ref.amax(module.weight.detach().numpy())
            assert float(meta.scale[1]) == expected[1]


@pytest.mark.parametrize("case", ["zero", "tiny", "normal", "inf", "nan"])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_scale_update_numeric_scenarios(case, fmt):
    # a DelayedScaling step whose only amax is `case`: the scale stays 1 for zero / inf / NaN, becomes FLT_MAX for
    # a tiny amax, fp8_max / amax otherwise (TE's _default_sf_compute cases)
    fp8_max = fmt.value.max_fwd
    amax = {"zero": 0.0, "tiny": fp8_max / float(torch.finfo(torch.float32).max) / 2, "normal": 0.731,
            "inf": float("inf"), "nan": float("nan")}[case]
    recipe = DelayedScaling(fp8_format=fmt, amax_history_len=1)
    module = te.Linear(16, 16, bias=False)
    with torch.no_grad():
        module.weight.zero_()
    x = torch.zeros(16, 16)
    x[3, 5] = amax
    for _ in range(2):
        with te.autocast(recipe=recipe):
            module(x)
    scale = float(module.fp8_meta[FP8GlobalStateManager.get_meta_tensor_key(forward=True)].scale[0])
    if case in ("zero", "inf", "nan"):
        assert scale == 1.0
    else:
        with np.errstate(over="ignore"):
            assert scale == ref.clamp_scale(ref.scaled_max(fp8_max, 0) / np.float32(amax))
    if case == "tiny":
        assert scale == float(torch.finfo(torch.float32).max)


def test_dynamic_recipe_update_warns_once_and_swaps_quantizers():
    linear = te.Linear(32, 32)
    for _ in range(2):
        with te.autocast(recipe=DelayedScaling()):
            linear(torch.randn(32, 32)).mean().backward()
    with pytest.warns(UserWarning, match="Recipe type changed"):
        with te.autocast(recipe=Float8CurrentScaling()):
            linear(torch.randn(32, 32)).mean().backward()
    assert isinstance(linear.fp8_meta["recipe"], Float8CurrentScaling)  # every recipe's call records it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.autocast(recipe=Float8CurrentScaling()):
            linear(torch.randn(32, 32)).mean().backward()


@pytest.mark.parametrize("module", ["Linear", "GroupedLinear"])
def test_quantizer_update_warns_on_a_new_history_length(module):
    with te.quantized_model_init(recipe=DelayedScaling(amax_history_len=1024)):
        layer = te.GroupedLinear(1, 32, 32) if module == "GroupedLinear" else te.Linear(32, 32)
    args = ([32],) if module == "GroupedLinear" else ()
    with te.autocast(recipe=DelayedScaling(amax_history_len=1)):
        with pytest.warns(UserWarning, match="Quantizer is being updated, this may affect model behavior"):
            layer(torch.randn(32, 32), *args)


def test_module_quantizers_follow_the_recipe():
    # TE's `module.quantizers` (test_dynamic_recipe_update): per GEMM 3 forward slots (input, weight, output) and 2
    # backward ones, of the last FP8 forward's recipe; TE's user-facing classes, quantizing as the module does
    layer = te.GroupedLinear(2, 32, 32)
    assert dict(layer.quantizers) == {"scaling_fwd": (), "scaling_bwd": ()}
    x = torch.randn(64, 32)
    for recipe, cls in ((DelayedScaling(margin=1), te.Float8Quantizer),
                        (Float8CurrentScaling(), te.Float8CurrentScalingQuantizer),
                        (MXFP8BlockScaling(), te.MXFP8Quantizer)):
        for _ in range(2):
            with te.autocast(recipe=recipe):
                layer(x, [32, 32]).sum().backward()
        q = layer.quantizers
        assert len(q["scaling_fwd"]) == 6 and len(q["scaling_bwd"]) == 4
        assert all(isinstance(one, cls) for one in q["scaling_fwd"] + q["scaling_bwd"])
        if isinstance(recipe, DelayedScaling):  # bound to the module's scales: the weight slot of GEMM 2
            assert q["scaling_fwd"][0].dtype == te.DType.kFloat8E4M3
            assert q["scaling_bwd"][0].dtype == te.DType.kFloat8E5M2
            scale = layer.fp8_meta["scaling_fwd"].scale[4].item()
            assert q["scaling_fwd"][4].scale.item() == scale
            w = layer.weight1.detach()
            want, _ = ref.cast(w.numpy(), "e4m3", scale)
            np.testing.assert_array_equal(q["scaling_fwd"][4](w)._data.numpy(), want)
        if isinstance(recipe, Float8CurrentScaling):
            want, _ = ref.current_cast(x.numpy(), "e4m3")
            np.testing.assert_array_equal(q["scaling_fwd"][0](x)._data.numpy(), want)
    with pytest.raises(TypeError):
        layer.quantizers["scaling_fwd"] = ()
