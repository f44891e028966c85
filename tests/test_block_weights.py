"""`quantized_model_init` under the block-scaling recipes (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling):
the weights are the family's quantized tensors with the reference quantization's bytes (tests/reference.py), the
modules' GEMMs read those bytes without quantizing the weight again, FusedAdam (master weights) and torch.optim
re-quantize them from the updated values, and checkpoints and copies keep the bytes."""

import copy
import io

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.tensor.block_storage import BlockQuantizer
from fp8kit.recipe import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

import reference as ref

RECIPES = {
    "mxfp8": MXFP8BlockScaling(),
    "mxfp8_2d": MXFP8BlockScaling(enable_2d_quantization=True),
    "block": Float8BlockScaling(),
    "block_w1d": Float8BlockScaling(w_block_scaling_dim=1),
    "nvfp4": NVFP4BlockScaling(),
}
CLASSES = {MXFP8BlockScaling: te.MXFP8Tensor, Float8BlockScaling: te.Float8BlockwiseQTensor,
           NVFP4BlockScaling: te.NVFP4Tensor}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def reference_layouts(recipe, w: np.ndarray) -> dict:
    """The weight `w` (float32 (N, K)) as the recipe's weight quantizer must hold it, from tests/reference.py:
    {layout: (data bytes, scale array as the tensor's unpadded scale accessor gives it)}."""
    if isinstance(recipe, MXFP8BlockScaling):
        if recipe.enable_2d_quantization:
            q, code = ref.mxfp8_quantize(w, "e4m3", (32, 32))
            return {"rowwise": (q, np.repeat(code, 32, 0)), "columnwise": (q, np.repeat(code, 32, 1))}
        return {"rowwise": ref.mxfp8_quantize(w, "e4m3", (1, 32)),
                "columnwise": ref.mxfp8_quantize(w, "e4m3", (32, 1))}
    if isinstance(recipe, Float8BlockScaling):
        qp = recipe.fp8_quant_fwd_weight
        two_d = recipe.w_block_scaling_dim == 2
        tile = (128, 128) if two_d else (1, 128)
        out = {}
        for name, x in (("rowwise", w), ("columnwise", np.ascontiguousarray(w.T))):
            q, s = ref.float8_block_quantize(x, "e4m3", tile, qp.power_2_scale, qp.amax_epsilon)
            out[name] = (q, np.repeat(s, 128, 0)[: x.shape[0]] if two_d else s)
        return out
    two_d = recipe.fp4_quant_fwd_weight.fp4_2d_quantization
    row, col = ref.nvfp4_quantize(w, two_d), ref.nvfp4_quantize(np.ascontiguousarray(w.T), two_d)
    return {"rowwise": row, "columnwise": col}


def held_layouts(param) -> dict:
    """The same view of a weight parameter's fields."""
    out = {}
    for columnwise, name in ((False, "rowwise"), (True, "columnwise")):
        data = _np(getattr(param, f"_{name}_data"))
        if isinstance(param, te.Float8BlockwiseQTensor):
            out[name] = (data, _np(param.block_scale_inv(columnwise)))
        elif isinstance(param, te.NVFP4Tensor):
            out[name] = (data, _np(param.block_scales(columnwise)), _np(getattr(param, f"_amax_{name}"))[0])
        else:
            out[name] = (data, _np(param.block_scales(columnwise)))
    return out


def assert_reference_bytes(recipe, param, value: torch.Tensor) -> None:
    want, held = reference_layouts(recipe, _np(value.float())), held_layouts(param)
    for name in ("rowwise", "columnwise"):
        for a, b in zip(held[name], want[name]):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name


def _init(weight):  # a spread of magnitudes, so that blocks get different scales
    with torch.no_grad():
        weight.copy_(torch.randn_like(weight) * torch.logspace(-3, 1, weight.shape[1]))


@pytest.mark.parametrize("name", list(RECIPES))
def test_weights_are_block_tensors_with_the_reference_bytes(name):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=True):
        layer = te.Linear(256, 128, init_method=_init)
    w = layer.weight
    assert type(w) is CLASSES[type(recipe)] and isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert w.shape == (128, 256) and w.dtype == torch.float32
    init = w.get_high_precision_init_val()
    assert init.device.type == "cpu" and init.shape == (128, 256)
    assert_reference_bytes(recipe, w, init)
    assert not torch.equal(w.dequantize(), init)  # the weight is quantized
    x = torch.randn(32, 256)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w.dequantize(), layer.bias))  # outside autocast
    w.clear_high_precision_init_val()
    assert w.get_high_precision_init_val() is None
    assert isinstance(layer.bias, torch.nn.Parameter) and not isinstance(layer.bias, te.QuantizedTensor)
    with te.quantized_model_init(enabled=False, recipe=recipe):
        assert not isinstance(te.Linear(64, 64).weight, te.QuantizedTensor)


def _modules(kind: str):
    if kind == "linear":
        return lambda: te.Linear(64, 96, init_method=_init)
    if kind == "layernorm_linear":
        return lambda: te.LayerNormLinear(64, 96, init_method=_init)
    return lambda: te.LayerNormMLP(64, 128, init_method=_init, output_layer_init_method=_init)


def _run(model, x, dy, recipe, seed):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)  # NVFP4's stochastic rounding of the gradient draws from it
    with te.autocast(recipe=recipe):
        y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp"])
@pytest.mark.parametrize("name", ["mxfp8", "block", "nvfp4"])
def test_modules_use_the_weight_bytes_as_they_are(name, kind, monkeypatch):
    """Forward and backward with block-scaled weights equal the high-precision-weight modules holding the
    weights' initial values (the weights hold the reference quantization of those: the test above), and no weight is
    quantized in the step (the high-precision modules quantize theirs)."""
    recipe = RECIPES[name]
    make = _modules(kind)
    torch.manual_seed(1)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        quantized = make()
    plain = make()
    weights = {n for n, p in quantized.named_parameters() if isinstance(p, te.QuantizedTensor)}
    assert len(weights) == (2 if kind == "layernorm_mlp" else 1)
    with torch.no_grad():
        for (n, p), q in zip(plain.named_parameters(), quantized.parameters()):
            p.copy_(q.get_high_precision_init_val() if n in weights else q)
    x, dy = torch.randn(32, 64), torch.randn(32, 64 if kind == "layernorm_mlp" else 96)
    shapes = []
    original = {cls: cls.quantize_impl for cls in BlockQuantizer.__subclasses__()}
    for cls, fn in original.items():
        monkeypatch.setattr(cls, "quantize_impl", lambda self, t, fn=fn: shapes.append(tuple(t.shape)) or fn(self, t))
    y, dx, grads = _run(quantized, x, dy, recipe, 7)
    weight_shapes = {tuple(p.shape) for n, p in quantized.named_parameters() if n in weights}
    assert shapes and not weight_shapes & set(shapes), (shapes, weight_shapes)
    shapes.clear()
    y_ref, dx_ref, grads_ref = _run(plain, x, dy, recipe, 7)
    assert weight_shapes <= set(shapes)  # the counter sees weight casts
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert type(g) is torch.Tensor and torch.equal(g, g_ref)


@pytest.mark.parametrize("name", ["mxfp8_2d", "block", "block_w1d", "nvfp4"])
def test_fused_adam_requantizes_from_the_master(name):
    recipe = RECIPES[name]
    torch.manual_seed(2)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        layer = te.Linear(128, 128, init_method=_init)
    w = layer.weight
    init = w.get_high_precision_init_val().clone()
    opt = te.optimizers.FusedAdam(layer.parameters(), lr=1e-2, master_weights=True)
    for _ in range(2):
        with te.autocast(recipe=recipe):
            y = layer(torch.randn(32, 128))
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    master = opt.get_unscaled_state(w, "master_param")
    assert master.dtype == torch.float32 and type(w) is CLASSES[type(recipe)]
    assert (master - init).abs().max() > 1e-3  # it moved: two Adam steps of lr 1e-2
    assert_reference_bytes(recipe, w, master)


@pytest.mark.parametrize("name", ["mxfp8", "block"])
def test_torch_sgd_requantizes_the_updated_values(name):
    recipe = RECIPES[name]
    torch.manual_seed(3)
    with te.quantized_model_init(recipe=recipe):
        layer = te.Linear(128, 128, bias=False, init_method=_init)
    with te.autocast(recipe=recipe):
        y = layer(torch.randn(32, 128))
    y.square().sum().backward()
    before, grad = layer.weight.dequantize(), layer.weight.grad.clone()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    assert type(layer.weight) is CLASSES[type(recipe)]
    assert_reference_bytes(recipe, layer.weight, before - 0.1 * grad)


@pytest.mark.parametrize("name", ["mxfp8", "block", "nvfp4"])
def test_state_dict_round_trip_and_deepcopy_keep_the_bytes(name):
    recipe = RECIPES[name]
    torch.manual_seed(4)
    with te.quantized_model_init(recipe=recipe):
        a = te.LayerNormMLP(64, 128, init_method=_init, output_layer_init_method=_init)
        b = te.LayerNormMLP(64, 128)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    twin = copy.deepcopy(a)
    for n, p in a.named_parameters():
        for other in (b, twin):
            q = dict(other.named_parameters())[n]
            assert type(q) is type(p)
            if isinstance(p, te.QuantizedTensor):
                for f, g in zip(p._fields().values(), q._fields().values()):
                    assert (f is None) == (g is None) and (f is None or torch.equal(f, g))
            else:
                assert torch.equal(p, q)
    twin.fc1_weight.quantize_(torch.zeros(128, 64))  # a copy shares no storage
    assert not torch.equal(twin.fc1_weight.dequantize(), a.fc1_weight.dequantize())
    plain = te.LayerNormMLP(64, 128)  # into high-precision weights: the values
    plain.load_state_dict(a.state_dict())
    assert torch.equal(plain.fc1_weight, a.fc1_weight.dequantize())
    x = torch.randn(32, 64)
    with te.autocast(recipe=recipe):
        assert torch.equal(a(x), b(x))


def test_a_weight_and_a_recipe_that_differ_are_refused():
    with te.quantized_model_init(recipe=MXFP8BlockScaling()):
        mx = te.Linear(64, 64)
    with te.quantized_model_init(recipe=Float8BlockScaling()):
        blk = te.Linear(128, 128)
    with te.quantized_model_init(recipe=DelayedScaling()):
        per_tensor = te.Linear(64, 64)
    x = torch.randn(32, 64)
    cases = [(mx, Float8BlockScaling(), "MXFP8Tensor"), (mx, DelayedScaling(), "MXFP8Tensor"),
             (mx, MXFP8BlockScaling(enable_2d_quantization=True), "with_2d_quantization"),
             (blk, Float8BlockScaling(w_block_scaling_dim=1), "block_scaling_dim"),
             (per_tensor, MXFP8BlockScaling(), "Float8Tensor")]
    for layer, recipe, words in cases:
        with pytest.raises(TypeError, match=words):
            with te.autocast(recipe=recipe):
                layer(torch.randn(32, layer.in_features))
    with te.autocast(recipe=MXFP8BlockScaling()):  # the matching recipe runs
        mx(x)


def test_a_weight_the_format_cannot_hold_is_refused_naming_it():
    with pytest.raises(ValueError, match="weight.*MXFP8BlockScaling.*divisible by 32"):
        with te.quantized_model_init(recipe=MXFP8BlockScaling()):
            te.Linear(40, 64)


@pytest.mark.parametrize("quantized", [False, True], ids=["high_precision", "quantized"])
def test_is_first_microbatch_caches_block_weights(quantized):
    """The weight cached by is_first_microbatch=True serves the next microbatches of the same recipe kind (NVFP4
    included); under another block recipe the cache is not used (its operands are another family's)."""
    torch.manual_seed(5)
    nv = NVFP4BlockScaling()
    with te.quantized_model_init(enabled=quantized, recipe=nv):
        layer = te.Linear(64, 64)
    x = torch.randn(32, 64)
    with te.autocast(recipe=nv):
        first = layer(x, is_first_microbatch=True)
        assert torch.equal(layer(x, is_first_microbatch=False), first)
    plain = te.Linear(64, 64)
    with te.autocast(recipe=MXFP8BlockScaling()):
        plain(x, is_first_microbatch=True)
    with te.autocast(recipe=Float8BlockScaling()):
        again, fresh = plain(x, is_first_microbatch=False), plain(x)
    assert torch.equal(again, fresh)
