"""Transformer Engine behaviours of the block-scaled tensors (MXFP8Tensor, Float8BlockwiseQTensor, NVFP4Tensor) that
TE's own tests exercise: `x.data = y` quantizes `y` (test_float8blockwisetensor.py `test_data_accessors`), the FSDP2
buffer protocol (`fsdp_extract_buffers` / `fsdp_assign_gathered`), weights made by `quantized_model_init` under
`torch.no_grad()` (test_sanity.py `test_inference_mode`) and zero-token GEMMs (`test_sanity_linear_with_zero_tokens`).
Bytes are checked against tests/reference.py (NumPy + ml_dtypes) through test_block_weights' helpers."""

import numpy as np
import pytest
import torch
from test_block_weights import CLASSES, RECIPES, assert_reference_bytes, held_layouts, reference_layouts

import fp8kit.pytorch as te
from fp8kit.pytorch.recipe_families import recipe_family
from fp8kit.recipe import Float8BlockScaling, MXFP8BlockScaling


def weight_quantizer(recipe):
    """The quantizer a weight parameter of `recipe` is made with (both layouts): what `reference_layouts` models."""
    return recipe_family(type(recipe)).weight_quantizer(recipe)


def spread(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])


# ---- x.data = y ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(RECIPES))
def test_setting_data_quantizes_the_new_value(name):
    recipe = RECIPES[name]
    q = weight_quantizer(recipe)
    x = torch.nn.Parameter(q.quantize(spread((256, 512), 0)))
    y = spread((256, 512), 1)
    x.data = y
    assert type(x) is CLASSES[type(recipe)] and isinstance(x, torch.nn.Parameter)
    assert x.requires_grad and x.shape == (256, 512) and x.dtype == torch.float32
    assert_reference_bytes(recipe, x, y)
    # what TE's test reads back: the data accessor's values are those of the quantized y
    assert torch.equal(x.data.dequantize(), q.quantize(y).dequantize())
    # a tensor of the same class hands over its fields, no quantization
    other = q.quantize(spread((256, 512), 2))
    x.data = other
    assert x._rowwise_data is other._rowwise_data and x._columnwise_data is other._columnwise_data
    assert torch.equal(x.dequantize(), other.dequantize())


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_setting_data_of_another_shape_and_dtype_follows_the_value(name):
    recipe = RECIPES[name]
    x = weight_quantizer(recipe).quantize(spread((64, 64), 0))
    y = spread((96, 128), 1).bfloat16()
    x.data = y
    assert x.shape == (96, 128) and x.dtype == torch.bfloat16 and not x.requires_grad
    assert_reference_bytes(recipe, x, y)


def test_float8_block_data_keeps_its_shape_and_dtype():
    recipe = RECIPES["block"]
    x = weight_quantizer(recipe).quantize(spread((128, 256), 0))
    y = spread((128, 256), 1).bfloat16()
    x.data = y  # quantized in place: the nominal dtype stays (TE's update_quantized)
    assert x.dtype == torch.float32
    assert_reference_bytes(recipe, x, y)
    with pytest.raises(ValueError, match=r"shape \(64, 256\).*\(128, 256\)"):
        x.data = spread((64, 256), 2)
    with pytest.raises(TypeError, match="must be set to a tensor"):
        x.data = 1.0


# ---- FSDP2 buffer protocol -----------------------------------------------------------------------------------------

def _gathered(shards, meta_of):
    """Each shard's `fsdp_extract_buffers` concatenated along dim 0, as FSDP2's all-gather gives them."""
    parts = [s.fsdp_extract_buffers() for s in shards]
    meta = parts[0][1]
    assert all(p[1] == meta for p in parts)
    return tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0]))), meta_of(meta)


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_float8_block_gather_round_trip(direction):
    recipe = RECIPES["block"]  # 128x128 weight blocks
    q = weight_quantizer(recipe)
    full = torch.cat([spread((128, 320), 0), spread((256, 320), 1)])
    shards = [q.quantize(full[:128]), q.quantize(full[128:])]
    for s in shards:
        s.update_usage(rowwise_usage=direction == "rowwise", columnwise_usage=direction == "columnwise")
    (data, scale), meta = _gathered(shards, dict)
    assert meta["direction"] == direction and data.shape == (384, 320) and scale.shape == (3, 3)
    out = q.make_empty((384, 320))
    out.update_usage(rowwise_usage=direction == "rowwise", columnwise_usage=direction == "columnwise")
    out.fsdp_assign_gathered((data, scale), meta)
    want = reference_layouts(recipe, full.numpy())[direction]
    got = held_layouts_one(out, direction)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    padded = q.get_scale_shape((384, 320), columnwise=direction == "columnwise")
    assert tuple(getattr(out, f"_{direction}_scale_inv").shape) == padded


def held_layouts_one(t, direction):
    return (getattr(t, f"_{direction}_data").numpy(), t.block_scale_inv(direction == "columnwise").numpy())


def test_float8_block_gather_refusals():
    q = weight_quantizer(RECIPES["block"])
    t = q.quantize(spread((128, 256), 0))
    kept = t._rowwise_data
    with pytest.raises(RuntimeError, match="gathered scale geometry"):  # TE's test_fsdp_assign_gathered_rejects_...
        t.fsdp_assign_gathered((torch.zeros(256, 256, dtype=torch.uint8), torch.ones(3, 2)), {"direction": "rowwise"})
    assert t._rowwise_data is kept
    with pytest.raises(RuntimeError, match="direction"):
        t.fsdp_assign_gathered((torch.zeros(256, 256, dtype=torch.uint8), torch.ones(2, 2)), {"direction": "rows"})
    with pytest.raises(RuntimeError, match="not a multiple of 128"):
        q.quantize(spread((96, 256), 0)).fsdp_extract_buffers()
    one_d = weight_quantizer(RECIPES["block_w1d"]).quantize(spread((128, 256), 0))
    with pytest.raises(NotImplementedError, match="block_scaling_dim=2"):
        one_d.fsdp_buffer_fields()


def test_mxfp8_gather_round_trip():
    recipe = RECIPES["mxfp8"]
    q = weight_quantizer(recipe)
    full = torch.cat([spread((64, 96), 0), spread((96, 96), 1)])
    shards = [q.quantize(full[:64]), q.quantize(full[64:])]
    gathered, meta = _gathered(shards, dict)
    assert meta["field_names"] == ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                                   "_columnwise_scale_inv")
    assert [tuple(b.shape) for b in gathered] == [(160, 96), (160, 4), (160, 96), (5, 128)]
    out = q.make_empty((160, 96))
    out.fsdp_assign_gathered(gathered, meta)
    assert out._rowwise_scale_inv.shape == (256, 4) and out._columnwise_scale_inv.shape == (8, 128)
    want, held = reference_layouts(recipe, full.numpy()), held_layouts(out)
    for name in ("rowwise", "columnwise"):
        for a, b in zip(held[name], want[name]):
            assert np.array_equal(a, b), name
    with pytest.raises(RuntimeError, match="2 buffers for 4 fields"):
        out.fsdp_assign_gathered(gathered[:2], meta)


# ---- quantized_model_init under torch.no_grad() ------------------------------------------------------------------

MODULES = {
    "Linear": lambda: te.Linear(64, 96, init_method=_init),
    "LayerNormLinear": lambda: te.LayerNormLinear(64, 96, init_method=_init),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 96, init_method=_init, output_layer_init_method=_init),
    "GroupedLinear": lambda: te.GroupedLinear(1, 64, 96, init_method=_init),
}


def _init(weight):
    with torch.no_grad():
        weight.copy_(torch.randn_like(weight) * torch.logspace(-3, 1, weight.shape[1]))


def _build(module, recipe, grad: bool):
    torch.manual_seed(0)
    with torch.set_grad_enabled(grad), te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        return MODULES[module]()


def _call(model, module, x, recipe):
    kwargs = {"m_splits": [x.shape[0]]} if module == "GroupedLinear" else {}
    with te.autocast(recipe=recipe):
        return model(x, **kwargs)


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("name", ["mxfp8", "block", "block_w1d", "nvfp4"])
def test_inference_weights_hold_the_rowwise_layout_only(name, module):
    recipe = RECIPES[name]
    model = _build(module, recipe, grad=False)
    weights = [p for p in model.parameters() if isinstance(p, te.QuantizedTensor)]
    assert weights
    for w in weights:
        assert w.get_usages() == {"rowwise": True, "columnwise": False}
        row_want = reference_layouts(recipe, w.get_high_precision_init_val().numpy())["rowwise"]
        data = w._rowwise_data.numpy()
        assert np.array_equal(data, row_want[0])
    trained = _build(module, recipe, grad=True)
    assert all(p.get_usages()["columnwise"] for p in trained.parameters() if isinstance(p, te.QuantizedTensor))
    x = torch.randn(32, 64)
    with torch.inference_mode():
        y = _call(model, module, x, recipe)
    assert all(p.get_usages()["columnwise"] is False for p in weights)  # still none after the forward
    assert torch.equal(y, _call(trained, module, x, recipe).detach())


@pytest.mark.parametrize("name", ["mxfp8", "block_w1d", "nvfp4"])
def test_training_inference_weights_names_the_missing_layout(name):
    recipe = RECIPES[name]
    model = _build("Linear", recipe, grad=False)
    y = _call(model, "Linear", torch.randn(32, 64, requires_grad=True), recipe)
    with pytest.raises(ValueError, match="no columnwise data"):
        y.sum().backward()


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_float8_block_2d_inference_weights_train_as_the_others(module):
    """With 128x128 blocks the columnwise layout is the rowwise one transposed (TE makes it so): training a model
    made under no_grad gives the gradients of one made with grad enabled, bit for bit."""
    recipe = RECIPES["block"]
    grads = []
    for grad in (False, True):
        model = _build(module, recipe, grad)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
        _call(model, module, x, recipe).square().sum().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
        weights = [p for p in model.parameters() if isinstance(p, te.QuantizedTensor)]
        assert all(p.get_usages()["columnwise"] for p in weights)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ---- zero tokens ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling()], ids=["mxfp8", "block"])
def test_zero_tokens(recipe, quantized):
    with te.quantized_model_init(enabled=quantized, recipe=recipe):
        layer = te.Linear(128, 256)
    x = torch.randn(0, 128, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 256) and x.grad.shape == (0, 128)
    assert not layer.weight.grad.any() and not layer.bias.grad.any()


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling()], ids=["mxfp8", "block"])
def test_grouped_linear_with_an_empty_split(recipe):
    torch.manual_seed(0)
    grouped = te.GroupedLinear(2, 64, 96)
    single = te.Linear(64, 96)
    with torch.no_grad():
        single.weight.copy_(grouped.weight1)
        single.bias.copy_(grouped.bias1)
    x = torch.randn(32, 64, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = grouped(x, [0, 32])
        y_single = single(x)
    torch.autograd.backward([y, y_single], [torch.ones_like(y), torch.ones_like(y_single)])
    assert torch.equal(y, y_single)
    assert not grouped.weight0.grad.any() and torch.equal(grouped.weight1.grad, single.weight.grad)
