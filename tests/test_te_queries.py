"""Transformer Engine's query names that TE code imports from its submodules (`quantization`, `_extra_state`, `utils`,
`module`): each answers as TE's does, checked against an answer made here independently (module state, NumPy,
hand-built pickles)."""

import pickle
import pickletools

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import utils
from fp8kit.pytorch._extra_state import (
    _RECIPE_POLICIES,
    UNSAFE_PICKLE_EXTRA_STATE_ENV,
    CheckpointExtraStatePolicy,
    is_stateless_recipe,
    should_load_extra_state_pickle,
)
from fp8kit.pytorch.modules import is_module_grouped_tensor_path_supported
from fp8kit.pytorch.quantization import FP8GlobalStateManager, get_align_size_for_quantization
from fp8kit.recipe import CustomRecipe, DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling

# ---- _extra_state: which pickled payloads need unpickling --------------------------------------------------------


def _no_quantizer(role):
    return None


def _payload(recipe, delayed_state=False):
    state = {"recipe": recipe, "extra_fp8_variables": {}}
    if delayed_state:
        state.update(scale_fwd=torch.ones(1), amax_history_fwd=torch.zeros(1, 1))
    return pickle.dumps(state)


def _global_pickle(module: str, name: str) -> bytes:
    """A protocol-0 pickle of {"recipe": <module.name>()} naming a class by GLOBAL, built by hand (the class need not
    exist: the classifier must never import or run anything)."""
    return (b"(dp0\nVrecipe\np1\nc" + module.encode() + b"\n" + name.encode() + b"\np2\n)Rp3\ns.")


class _Boom:
    ran = False

    def __reduce__(self):
        return (_Boom._explode, ())

    @staticmethod
    def _explode():
        _Boom.ran = True


def test_hand_built_pickle_is_well_formed():
    ops = [op.name for op, _, _ in pickletools.genops(_global_pickle("transformer_engine.common.recipe", "X"))]
    assert "GLOBAL" in ops and ops[-1] == "STOP"


@pytest.mark.parametrize("payload", [b"", pickle.dumps({}), pickle.dumps({"extra_fp8_variables": {}}),
                                     _payload(Float8CurrentScaling()), _payload(MXFP8BlockScaling()),
                                     _payload(CustomRecipe(qfactory=_no_quantizer)),
                                     _global_pickle("transformer_engine.common.recipe", "Float8CurrentScaling")])
def test_stateless_payload_is_ignored(payload, monkeypatch):
    monkeypatch.delenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, raising=False)
    assert should_load_extra_state_pickle(payload, "layer") is False


@pytest.mark.parametrize("payload", [_payload(DelayedScaling()), _payload(Float8CurrentScaling(), delayed_state=True),
                                     _global_pickle("transformer_engine.common.recipe", "DelayedScaling"),
                                     _global_pickle("mypkg", "Unknown"), pickle.dumps({"scale_fwd": torch.ones(1)}),
                                     b"not a pickle"])
def test_payload_that_needs_unpickling_asks_for_opt_in(payload, monkeypatch):
    monkeypatch.delenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=UNSAFE_PICKLE_EXTRA_STATE_ENV) as err:
        should_load_extra_state_pickle(payload, "decoder.3.fc1")
    assert "decoder.3.fc1" in str(err.value)
    monkeypatch.setenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, "1")
    assert should_load_extra_state_pickle(payload, "decoder.3.fc1") is True


def test_classifier_runs_nothing(monkeypatch):
    monkeypatch.setenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, "1")
    payload = pickle.dumps({"recipe": _Boom()})
    assert should_load_extra_state_pickle(payload, "x") is True  # an unknown global: only unpickling could tell
    assert not _Boom.ran
    with pytest.raises(TypeError, match="bytes"):
        should_load_extra_state_pickle("text", "x")


def test_policy_table_covers_every_recipe_class():
    import fp8kit.recipe as recipes
    classes = {c.__name__ for c in vars(recipes).values()
               if isinstance(c, type) and issubclass(c, recipes.Recipe) and c is not recipes.Recipe}
    assert {name for _, name in _RECIPE_POLICIES} == classes
    assert is_stateless_recipe(Float8CurrentScaling()) and not is_stateless_recipe(DelayedScaling())
    assert _RECIPE_POLICIES[("fp8kit.recipe", "CustomRecipe")] is CheckpointExtraStatePolicy.DYNAMIC


# ---- quantization: FP8GlobalStateManager, get_align_size_for_quantization ----------------------------------------


def test_meta_tensor_keys_name_the_module_states():
    with te.autocast(recipe=DelayedScaling()):
        layer = te.Linear(16, 16)
        layer(torch.randn(16, 16)).sum().backward()
    fwd, bwd = (layer.fp8_meta[FP8GlobalStateManager.get_meta_tensor_key(forward=f)] for f in (True, False))
    assert fwd.num_slots == 3 and bwd.num_slots == 2  # input/weight/output and grad_output/grad_input
    assert FP8GlobalStateManager.get_fwd_bwd_key(False) == "backward"


def test_state_queries_follow_autocast():
    recipe = Float8CurrentScaling()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert FP8GlobalStateManager.get_fp8_recipe() == te.get_default_recipe()
    with te.autocast(recipe=recipe):
        # the recipe as it was at entry (autocast keys on a snapshot of its fields)
        assert FP8GlobalStateManager.is_fp8_enabled() and repr(FP8GlobalStateManager.get_fp8_recipe()) == repr(recipe)
        with te.autocast(enabled=False):
            assert not FP8GlobalStateManager.is_fp8_enabled()
            assert FP8GlobalStateManager.get_autocast_depth() == 2
    assert FP8GlobalStateManager.is_fp8_available() == te.is_fp8_available(return_reason=True)
    with pytest.raises(TypeError):
        FP8GlobalStateManager()


def test_reset_drops_an_autocast_left_open():
    ctx = te.autocast(recipe=DelayedScaling())
    ctx.__enter__()
    assert FP8GlobalStateManager.is_fp8_enabled()
    FP8GlobalStateManager.reset()
    assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_autocast_depth() == 0


@pytest.mark.parametrize("recipe, block", [(DelayedScaling(), None), (Float8CurrentScaling(), None),
                                           (MXFP8BlockScaling(), "mx"), (NVFP4BlockScaling(), "nv")])
def test_align_size(recipe, block):
    # the per-tensor FP8 GEMM needs 16-multiples; a block recipe needs its scaling block along the grouped rows
    expected = {None: 16, "mx": 32, "nv": 128}[block]
    assert get_align_size_for_quantization(recipe) == expected
    assert get_align_size_for_quantization(CustomRecipe(qfactory=_no_quantizer, quantization_alignment=48)) == 48
    with pytest.raises(TypeError, match="Recipe"):
        get_align_size_for_quantization("delayed")


# ---- utils ---------------------------------------------------------------------------------------------------------


def test_init_methods_draw_with_the_stated_std():
    torch.manual_seed(0)
    w = utils.init_method_normal(0.5)(torch.empty(400, 500))
    v = utils.scaled_init_method_normal(0.5, 8)(torch.empty(400, 500))
    a, b = w.double().numpy(), v.double().numpy()
    assert abs(a.std() - 0.5) < 0.01 and abs(b.std() - 0.5 / np.sqrt(16.0)) < 0.0025 and abs(a.mean()) < 0.01
    with pytest.raises(ValueError, match="num_layers"):
        utils.scaled_init_method_normal(0.5, 0)
    with pytest.raises(ValueError, match="sigma"):
        utils.init_method_normal(-1.0)


def test_attention_mask_func_fills_masked_positions():
    scores = torch.randn(2, 3, 4, 4)
    mask = torch.rand(2, 1, 4, 4) > 0.5
    expected = np.where(np.broadcast_to(mask.numpy(), scores.shape), -10000.0, scores.numpy())
    out = utils.attention_mask_func(scores, mask)
    assert out is scores and np.array_equal(out.numpy(), expected.astype(np.float32))
    with pytest.raises(TypeError, match="bool"):
        utils.attention_mask_func(scores, mask.float())


def test_gpu_autocast_ctx_is_the_compute_device_autocast():
    device = utils.autocast_device_type()
    assert device == ("cuda" if torch.cuda.is_available() else "cpu")
    with utils.gpu_autocast_ctx(enabled=True, dtype=torch.bfloat16):
        assert torch.is_autocast_enabled(device)
        y = torch.nn.functional.linear(torch.randn(4, 8, device=device), torch.randn(8, 8, device=device))
    assert y.dtype == torch.bfloat16 and not torch.is_autocast_enabled(device)
    with pytest.raises(TypeError, match="device_type"):
        utils.gpu_autocast_ctx(device_type="cpu")


def test_non_tn_layout_answer_matches_the_transpose_made():
    # the answer is what the quantizer does: a columnwise-usage Float8Tensor on the compute device carries a
    # transposed copy exactly when the layout is TN-only
    device = utils.autocast_device_type()
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, device=device, rowwise=True, columnwise=True)
    x = q(torch.randn(8, 16, device=device))
    assert utils.is_non_tn_fp8_gemm_supported() is (device == "cpu")
    assert (x._transpose is None) is utils.is_non_tn_fp8_gemm_supported()


def test_no_grouped_tensor_path_so_use_grouped_tensor_falls_back():
    assert is_module_grouped_tensor_path_supported(Float8CurrentScaling(), torch.bfloat16) is False
    torch.manual_seed(1)
    asked = te.GroupedLinear(2, 16, 8, use_grouped_tensor=True)
    x = torch.randn(12, 16)
    # the fallback: each split through its own weight, as separate matmuls in float64 compute it
    expected = torch.cat([x[:5].double() @ asked.weight0.double().T + asked.bias0.double(),
                          x[5:].double() @ asked.weight1.double().T + asked.bias1.double()])
    torch.testing.assert_close(asked(x, [5, 7]).double(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="use_grouped_tensor"):
        te.GroupedLinear(2, 16, 8, use_grouped_tensor=1)


@pytest.mark.parametrize("bias", [True, False])
def test_delayed_wgrad_refuses_the_implicit_fallback_with_a_bias(bias):
    layer = te.GroupedLinear(2, 16, 8, bias=bias, delay_wgrad_compute=True, use_grouped_tensor=True)
    layer(torch.randn(8, 16, requires_grad=True), [4, 4]).sum().backward()
    if bias:
        with pytest.raises(RuntimeError, match="implicit fallback is unsupported with delay_wgrad_compute=True"):
            layer.backward_dw()
        assert layer.weight0.grad is None  # nothing computed
    else:
        layer.backward_dw()
        assert layer.weight0.grad is not None and layer.weight1.grad is not None


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_default_sf_compute_is_te_default_scale_rule(margin):
    from fp8kit.pytorch.quantization import _default_sf_compute

    from reference import clamp_scale, scaled_max

    fp8_max = 448.0
    amax = torch.tensor([0.0, 1e-38, 0.7311, 3.0e5, float("inf"), float("nan")])
    old = torch.tensor([2.0, 3.0, 5.0, 7.0, 11.0, 13.0])
    scale = old.clone()
    out = _default_sf_compute(amax, scale, fp8_max, margin)
    assert out is scale
    expected = []
    for a, s in zip(amax.numpy(), old.numpy()):
        with np.errstate(over="ignore", divide="ignore"):
            ok = np.isfinite(a) and a > 0
            expected.append(clamp_scale(scaled_max(fp8_max, margin) / np.float32(a)) if ok else s)
    np.testing.assert_array_equal(scale.numpy(), np.array(expected, dtype=np.float32))
    assert scale[1] == torch.finfo(torch.float32).max  # a tiny amax: the quotient overflows to FLT_MAX


def test_te_dtype_mapping_has_te_numbers():
    """`constants.TE_DType` as TE defines it: seven torch dtypes to NVTEDType numbers (transformer_engine.h)."""
    from fp8kit.pytorch.constants import TE_DType, TE_DType_To_Torch

    expected = {torch.uint8: 0, torch.int32: 2, torch.float32: 4, torch.float16: 5, torch.bfloat16: 6,
                torch.float8_e4m3fn: 7, torch.float8_e5m2: 8}
    assert {d: int(v) for d, v in TE_DType.items()} == expected
    assert all(TE_DType_To_Torch[v] is d for d, v in TE_DType.items())


@pytest.mark.parametrize("fmt,fwd,bwd", [("E4M3", torch.float8_e4m3fn, torch.float8_e4m3fn),
                                         ("E5M2", torch.float8_e5m2, torch.float8_e5m2),
                                         ("HYBRID", torch.float8_e4m3fn, torch.float8_e5m2)])
def test_get_fp8_dtype_of_recipe(fmt, fwd, bwd):
    from fp8kit.pytorch.quantization import get_fp8_te_dtype, get_fp8_torch_dtype
    from fp8kit.recipe import DelayedScaling, Format

    r = DelayedScaling(fp8_format=getattr(Format, fmt))
    assert get_fp8_torch_dtype(r) is fwd and get_fp8_torch_dtype(r, fprop_tensor=False) is bwd
    numbers = {torch.float8_e4m3fn: 7, torch.float8_e5m2: 8}  # NVTEDType kFloat8E4M3, kFloat8E5M2
    assert int(get_fp8_te_dtype(r)) == numbers[fwd] and int(get_fp8_te_dtype(r, False)) == numbers[bwd]


def test_quantization_module_exports_autocast():
    """TE defines `autocast` in transformer_engine.pytorch.quantization; TE's tests import it from there."""
    from fp8kit.pytorch import quantization

    assert quantization.autocast is te.autocast
