"""fp8kit.pytorch.GroupedLinear, Fp8Padding, Fp8Unpadding: high precision against torch ops per split, FP8 bit for
bit against one fp8kit Linear per split (with the states mapped to Transformer Engine's per-GEMM slots), the slot
layout against tests/reference.py, weight-gradient options and errors naming m_splits."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref
from linear_helpers import np32

DELAYED = DelayedScaling(amax_history_len=3)
CURRENT = Float8CurrentScaling()
SPLITS = [[5, 0, 7], [4, 6, 2], [0, 12, 0]]  # with experts that get no token


def bitwise_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def separate_linears(grouped):
    """One fp8kit Linear per GEMM with the grouped module's parameters."""
    layers = []
    for i in range(grouped.num_gemms):
        w = getattr(grouped, f"weight{i}")
        layer = te.Linear(grouped.in_features, grouped.out_features, bias=grouped.use_bias, params_dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
            if grouped.use_bias:
                layer.bias.copy_(getattr(grouped, f"bias{i}"))
        layers.append(layer)
    return layers


def test_parameters_and_init_are_transformer_engines():
    torch.manual_seed(0)
    g = te.GroupedLinear(3, 16, 8)
    assert [n for n, _ in g.named_parameters()] == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    torch.manual_seed(0)
    for i in range(3):
        assert torch.equal(getattr(g, f"weight{i}"), torch.empty(8, 16).normal_(0.0, 0.023))
        assert not getattr(g, f"bias{i}").any()
    nb = te.GroupedLinear(2, 16, 8, bias=False, params_dtype=torch.bfloat16)
    assert nb.bias0 is None and nb.weight1.dtype == torch.bfloat16
    assert [n for n, _ in nb.named_parameters()] == ["weight0", "weight1"]
    col = te.GroupedLinear(2, 16, 8, bias=False, parallel_mode="column", tp_size=2)
    row = te.GroupedLinear(2, 16, 8, bias=False, parallel_mode="row", tp_size=2)
    assert col.weight0.shape == (4, 16) and row.weight0.shape == (8, 8)


def test_outside_autocast_equals_f_linear_per_split():
    torch.manual_seed(1)
    g = te.GroupedLinear(3, 16, 8)
    with torch.no_grad():
        for i in range(3):
            getattr(g, f"bias{i}").uniform_(-1, 1)
    x = torch.randn(12, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(12, 8)
    for splits in SPLITS:
        x.grad = x2.grad = None
        g.zero_grad()
        with te.autocast(enabled=False):
            y = g(x, splits)
        y.backward(dy)
        got = [y, x.grad] + [p.grad.clone() for p in g.parameters()]
        g.zero_grad()
        parts = x2.split(splits)
        want_y = torch.cat([F.linear(p, getattr(g, f"weight{i}"), getattr(g, f"bias{i}"))
                            for i, p in enumerate(parts)])
        want_y.backward(dy)
        want = [want_y, x2.grad] + [p.grad for p in g.parameters()]
        assert all(bitwise_equal(a, b) for a, b in zip(got, want))
    assert g.fp8_meta["scaling_fwd"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fp8_grouped_is_bit_identical_to_one_linear_per_split(recipe, dtype):
    torch.manual_seed(2)
    g = te.GroupedLinear(3, 16, 8, params_dtype=dtype)
    layers = separate_linears(g)
    # other autocast keys for the separate layers: one key's update must not tidy up the other's states
    other = dataclasses.replace(recipe, reduce_amax=False) if recipe is DELAYED else recipe
    gen = torch.Generator().manual_seed(3)
    for step, splits in enumerate(SPLITS):
        x = (torch.randn(2, 6, 16, generator=gen) * 2.0 ** step).to(dtype)  # any leading dims: 12 rows
        dy = torch.randn(2, 6, 8, generator=gen).to(dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            ya = g(xa, splits)
        with te.autocast(recipe=other):
            yb = torch.cat([layer(part) for layer, part in zip(layers, xb.reshape(12, 16).split(splits))])
        ya.backward(dy)
        yb.backward(dy.reshape(12, 8))
        assert ya.shape == (2, 6, 8)
        assert bitwise_equal(ya.reshape(12, 8), yb) and bitwise_equal(xa.grad, xb.grad), f"step {step}"
        for i, layer in enumerate(layers):
            assert bitwise_equal(getattr(g, f"weight{i}").grad, layer.weight.grad), f"step {step}: weight{i}"
            assert bitwise_equal(getattr(g, f"bias{i}").grad, layer.bias.grad), f"step {step}: bias{i}"
            layer.zero_grad()
        g.zero_grad()
        if recipe is DELAYED:
            for name in ("scaling_fwd", "scaling_bwd"):
                state = g.fp8_meta[name]
                want_h = torch.cat([layer.fp8_meta[name].amax_history for layer in layers], dim=1)
                want_s = torch.cat([layer.fp8_meta[name].scale for layer in layers])
                assert torch.equal(state.amax_history, want_h) and torch.equal(state.scale, want_s), (step, name)


def test_slot_layout_holds_the_reference_amaxes():
    """Forward slots 3i + [input, weight, output], backward 2i + [grad_output, grad_input]; an expert without
    tokens records its weight but no input and no gradient (those slots do not roll)."""
    torch.manual_seed(4)
    g = te.GroupedLinear(3, 16, 8)
    recipe = DelayedScaling(amax_history_len=2)
    fwd_ref, bwd_ref = ref.DelayedState(2, 9, 448.0), ref.DelayedState(2, 6, 57344.0)
    gen = torch.Generator().manual_seed(5)
    for splits in SPLITS:
        x = torch.randn(12, 16, generator=gen) * 3
        dy = torch.randn(12, 8, generator=gen)
        with te.autocast(recipe=recipe):
            y = g(x.requires_grad_(), splits)
        y.backward(dy)
        for i, (xs, dys) in enumerate(zip(x.detach().split(splits), dy.split(splits))):
            fwd_ref.record(3 * i, ref.amax(np32(xs)))
            fwd_ref.record(3 * i + 1, ref.amax(np32(getattr(g, f"weight{i}"))))
            bwd_ref.record(2 * i, ref.amax(np32(dys)))
        fwd_ref.update()
        bwd_ref.update()
        for state, r in ((g.fp8_meta["scaling_fwd"], fwd_ref), (g.fp8_meta["scaling_bwd"], bwd_ref)):
            np.testing.assert_array_equal(state.amax_history.numpy(), r.history, err_msg=str(splits))
            np.testing.assert_array_equal(state.scale.numpy(), r.scale, err_msg=str(splits))
    assert g.fp8_meta["scaling_fwd"].scale[2] == 1 and g.fp8_meta["scaling_bwd"].scale[1] == 1  # output/grad_input


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fuse_wgrad_accumulation_and_delayed_wgrad(recipe):
    torch.manual_seed(6)
    fused = te.GroupedLinear(2, 16, 8, fuse_wgrad_accumulation=True)
    delayed = te.GroupedLinear(2, 16, 8, delay_wgrad_compute=True)
    plain = copy.deepcopy(fused)
    plain.fuse_wgrad_accumulation = False
    delayed.load_state_dict(plain.state_dict())
    for i in range(2):
        getattr(fused, f"weight{i}").main_grad = torch.full((8, 16), 7.0)
    gen = torch.Generator().manual_seed(7)
    for micro in range(2):
        x = torch.randn(10, 16, generator=gen)
        for module in (fused, plain, delayed):
            with te.autocast(recipe=recipe):
                y = module(x, [3, 7], is_first_microbatch=micro == 0)
            y.square().sum().backward()
        if micro == 0:
            assert delayed.weight0.grad is None and delayed.weight1.grad is None
        assert delayed.need_backward_dw()
        delayed.backward_dw()
    assert not delayed.need_backward_dw()
    for i in range(2):
        wf, wp, wd = (getattr(m, f"weight{i}") for m in (fused, plain, delayed))
        assert wf.grad is None and torch.equal(wf.main_grad, wp.grad)  # float32 sum over the microbatches
        assert torch.equal(wd.grad, wp.grad)


def test_is_first_microbatch_caches_every_fp8_weight():
    torch.manual_seed(9)
    g = te.GroupedLinear(2, 16, 8)
    x = torch.randn(10, 16)
    with te.autocast(recipe=DELAYED):
        y1 = g(x, [4, 6], is_first_microbatch=True)
        with torch.no_grad():
            g.weight0.mul_(2.0)
            g.weight1.mul_(2.0)
        y2 = g(x, [4, 6], is_first_microbatch=False)  # the cached FP8 weights ignore the change
    assert torch.equal(y1, y2)
    with te.autocast(recipe=DELAYED):
        g(x, [4, 6], is_first_microbatch=False)
        staging = g.fp8_meta["scaling_fwd"].amax_history[0]
        assert staging[1] == 0 and staging[4] == 0 and staging[0] > 0 and staging[3] > 0  # no weight cast
        g(x, [4, 6])
        assert staging[1] == ref.amax(np32(g.weight0)) and staging[4] == ref.amax(np32(g.weight1))


def test_bad_splits_and_arguments_are_named():
    g = te.GroupedLinear(3, 16, 8)
    x = torch.randn(12, 16)
    for splits, message in (([5, 7], "m_splits has 2 entries, expected num_gemms=3"),
                            ([5, 0, 6], r"m_splits \[5, 0, 6\] sum to 11, but the input has 12 rows"),
                            ([13, -1, 0], r"m_splits must be >= 0, got \[13, -1, 0\]")):
        for recipe in (None, DELAYED):
            with pytest.raises(ValueError, match=message):
                with te.autocast(enabled=recipe is not None, recipe=recipe):
                    g(x, splits)
    with pytest.raises(TypeError, match="m_splits must be a list of ints"):
        g(x, [5.0, 0, 7])
    assert g(x, torch.tensor([5, 0, 7])).shape == (12, 8)  # Transformer Engine passes a tensor
    with pytest.raises(ValueError, match="in_features=16"):
        g(torch.randn(12, 15), [5, 0, 7])
    with pytest.raises(ValueError, match="bias=True with tp_size=2"):
        te.GroupedLinear(2, 16, 8, tp_size=2, parallel_mode="column")
    with pytest.raises(ValueError, match="out_features=9 is not divisible"):
        te.GroupedLinear(2, 16, 9, bias=False, tp_size=2, parallel_mode="column")
    with pytest.raises(NotImplementedError, match="single_grouped_weight"):
        te.GroupedLinear(2, 16, 8, single_grouped_weight=True)
    with pytest.raises(ValueError, match="num_gemms must be an int >= 1"):
        te.GroupedLinear(0, 16, 8)
    split = te.GroupedLinear(2, 16, 8, bias=False, tp_size=2, parallel_mode="row")
    with pytest.raises(ValueError, match="current scaling with tp_size=2"):
        with te.autocast(recipe=CURRENT):
            split(torch.randn(4, 8), [2, 2])


# ---- Fp8Padding / Fp8Unpadding -------------------------------------------------------------------------------

def test_padding_round_trip_and_gradients():
    pad, unpad = te.Fp8Padding(3), te.Fp8Unpadding(3)
    x = torch.randn(37, 8, requires_grad=True)
    splits = [5, 0, 32]
    y, padded = pad(x, splits)
    assert padded == [16, 0, 32] and y.shape == (48, 8)
    assert torch.equal(y[:5], x[:5]) and not y[5:16].any() and torch.equal(y[16:], x[5:])
    back = unpad(y, splits)
    assert torch.equal(back, x)
    g = torch.randn(37, 8)
    back.backward(g)
    assert torch.equal(x.grad, g)
    aligned = torch.randn(32, 8)
    same, same_splits = pad(aligned, [16, 0, 16])
    assert same is aligned and same_splits == [16, 0, 16] and unpad(aligned, [16, 0, 16]) is aligned
    assert te.Fp8Padding(2, align_size=8)(torch.randn(9, 4), [3, 6])[1] == [8, 8]


def test_padding_errors_name_m_splits():
    with pytest.raises(ValueError, match="m_splits has 1 entries, expected num_gemms=2"):
        te.Fp8Padding(2)(torch.randn(4, 8), [4])
    with pytest.raises(ValueError, match=r"sum to 5, but the input has 4 rows"):
        te.Fp8Padding(2)(torch.randn(4, 8), [2, 3])
    with pytest.raises(ValueError, match=r"padded to multiples of 16 sum to 32, but the input has 20 rows"):
        te.Fp8Unpadding(2)(torch.randn(20, 8), [2, 3])
    with pytest.raises(ValueError, match="align_size must be an int >= 1"):
        te.Fp8Padding(2, align_size=0)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_padded_grouped_linear_gives_the_unpadded_rows(recipe):
    """Zero rows change no amax, and each output row depends only on its input row: padding, the grouped GEMMs and
    unpadding give the rows of the unpadded run."""
    torch.manual_seed(8)
    g = te.GroupedLinear(3, 16, 8)
    twin = copy.deepcopy(g)
    x = torch.randn(13, 16)
    splits = [5, 0, 8]
    with te.autocast(recipe=recipe):
        padded_x, padded = te.Fp8Padding(3)(x, splits)
        y = te.Fp8Unpadding(3)(g(padded_x, padded), splits)
    with te.autocast(recipe=recipe):
        want = twin(x, splits)
    assert padded == [16, 0, 16] and y.shape == want.shape
    torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fp8_weights_equal_one_linear_per_split(recipe):
    other = dataclasses.replace(recipe, reduce_amax=False) if recipe is DELAYED else recipe
    torch.manual_seed(10)
    with te.quantized_model_init(recipe=recipe):
        g = te.GroupedLinear(2, 16, 8)
    torch.manual_seed(10)
    with te.quantized_model_init(recipe=other):
        layers = [te.Linear(16, 8), te.Linear(16, 8)]
    assert all(isinstance(getattr(g, f"weight{i}"), te.Float8Tensor) for i in range(2))
    x = torch.randn(10, 16)
    with te.autocast(recipe=recipe):
        ya = g(x, [3, 7])
    with te.autocast(recipe=other):
        yb = torch.cat([layer(part) for layer, part in zip(layers, x.split([3, 7]))])
    assert bitwise_equal(ya, yb)
    if recipe is DELAYED:  # each weight's quantizer staged its amax in its GEMM's weight slot
        staged = [g.fp8_meta["scaling_fwd"].amax_history[-1, 3 * i + 1] for i in range(2)]
        assert staged == [layer.fp8_meta["scaling_fwd"].amax_history[-1, 1] for layer in layers]
