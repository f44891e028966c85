"""fp8kit.pytorch.Linear: histories, scales and GEMMs against tests/reference.py and float64 math."""

import math

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

import reference as ref
from linear_helpers import assert_gemm_close, deq, np32, sqnr_db

FMT_NAMES = {Format.E4M3: ("e4m3", "e4m3"), Format.E5M2: ("e5m2", "e5m2"), Format.HYBRID: ("e4m3", "e5m2")}
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def make_refs(recipe):
    f = recipe.fp8_format.value
    kw = dict(margin=recipe.margin, algo=recipe.amax_compute_algo, interval=recipe.interval,
              power_2=recipe.power_2_scale)
    return (ref.DelayedState(recipe.amax_history_len, 3, f.max_fwd, **kw),
            ref.DelayedState(recipe.amax_history_len, 2, f.max_bwd, **kw))


def step_inputs(step, rng, shape):
    """Changing magnitudes, zero inputs, and inputs holding inf or NaN."""
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
    g = (rng.standard_normal(shape[:-1] + (24,)) * 10.0 ** rng.integers(-4, 3)).astype(np.float32)
    if step % 7 == 3:
        x[:] = 0
    if step % 11 == 5:
        x[0, 0] = np.inf
    if step % 13 == 6:
        x[1, 1] = np.nan
    if step % 9 == 4:
        g[:] = 0
    return x, g


@pytest.mark.parametrize("recipe", [
    DelayedScaling(amax_history_len=4),
    DelayedScaling(amax_history_len=1),
    DelayedScaling(amax_history_len=5, amax_compute_algo="most_recent", margin=2),
    DelayedScaling(amax_history_len=3, interval=3, fp8_format=Format.E4M3),
    DelayedScaling(amax_history_len=6, fp8_format=Format.E5M2, power_2_scale=True),
])
def test_histories_and_scales_follow_reference_every_step(recipe):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    layer, other = te.Linear(16, 24), te.Linear(16, 24)
    refs = {layer: make_refs(recipe), other: make_refs(recipe)}
    for step in range(30):
        skip = step % 5 == 2  # `layer` does not run in this step; `other` keeps the key busy
        x, g = step_inputs(step, rng, (6, 16))
        used = [other] if skip else [layer, other]
        with te.autocast(recipe=recipe):
            outs = [m(torch.from_numpy(x)) for m in used]
        sum((o * torch.from_numpy(g)).sum() for o in outs).backward()
        for m in (layer, other):
            fwd, bwd = refs[m]
            if m in used:
                fwd.record(0, ref.amax(x))
                fwd.record(1, ref.amax(np32(m.weight)))
                bwd.record(0, ref.amax(g))
            fwd.update()
            bwd.update()
            meta = m.fp8_meta
            for state, r in ((meta["scaling_fwd"], fwd), (meta["scaling_bwd"], bwd)):
                np.testing.assert_array_equal(state.amax_history.numpy(), r.history, err_msg=f"step {step}")
                np.testing.assert_array_equal(state.scale.numpy(), r.scale, err_msg=f"step {step}")
                assert torch.isfinite(state.scale).all() and (state.scale > 0).all()
        with torch.no_grad():  # move the weights so the weight amax changes too
            for m in (layer, other):
                m.weight.mul_(1.3 if step % 2 else 0.8)


def test_callable_algorithms_in_a_module():
    seen = []

    def amax_algo(history):
        seen.append(tuple(history.shape))
        return history.amax(dim=0)

    def scale_algo(amax, scale, fp8_max, recipe):
        return torch.where(amax > 0, fp8_max / (4 * amax.clamp_min(1e-30)), scale)

    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=amax_algo, scaling_factor_compute_algo=scale_algo)
    layer = te.Linear(16, 16)
    x = torch.randn(4, 16) * 5
    for _ in range(3):
        with te.autocast(recipe=recipe):
            layer(x).sum().backward()
    assert (3, 3) in seen and (3, 2) in seen  # called on full [L, n] forward and backward histories
    amax_x = ref.amax(np32(x))
    # the callable's own `float / tensor` rounds twice in torch, so allow one float32 ulp
    assert layer.fp8_meta["scaling_fwd"].scale[0].item() == pytest.approx(448.0 / (4 * float(amax_x)), rel=2e-7)


def _scales_used(layer, recipe, x, g):
    """Run one step; return the scales the casts used (the ones before this step's updates)."""
    fwd_scale = layer.fp8_meta["scaling_fwd"].scale.clone() if layer.fp8_meta["scaling_fwd"] is not None else None
    bwd_scale = layer.fp8_meta["scaling_bwd"].scale.clone() if layer.fp8_meta["scaling_bwd"] is not None else None
    return fwd_scale, bwd_scale


@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3, Format.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delayed", [True, False])
def test_three_gemms_equal_float64_on_reference_quantized_operands(fmt, dtype, delayed):
    torch.manual_seed(1)
    fwd_name, bwd_name = FMT_NAMES[fmt]
    recipe = DelayedScaling(amax_history_len=4, fp8_format=fmt) if delayed else Float8CurrentScaling(fp8_format=fmt)
    layer = te.Linear(48, 32, params_dtype=dtype)
    x = (torch.randn(2, 8, 48) * 3).to(dtype).requires_grad_()
    g = (torch.randn(2, 8, 32) * 1e-3).to(dtype)
    for step in range(3):  # step 0 casts with scale 1; later steps with calibrated scales
        x.grad = None
        layer.zero_grad()
        if delayed and step > 0:
            s_fwd = layer.fp8_meta["scaling_fwd"].scale.clone().numpy()
            s_bwd = layer.fp8_meta["scaling_bwd"].scale.clone().numpy()
        elif delayed:
            s_fwd, s_bwd = np.ones(3, np.float32), np.ones(2, np.float32)
        with te.autocast(recipe=recipe):
            y = layer(x)
        y.backward(g)
        xs, ws, gs = np32(x).reshape(-1, 48), np32(layer.weight), np32(g).reshape(-1, 32)
        if not delayed:
            s_fwd = [ref.current_scale(ref.amax(xs), 448.0 if fwd_name == "e4m3" else 57344.0),
                     ref.current_scale(ref.amax(ws), 448.0 if fwd_name == "e4m3" else 57344.0)]
            s_bwd = [ref.current_scale(ref.amax(gs), 448.0 if bwd_name == "e4m3" else 57344.0)]
        xq, wq, gq = deq(xs, fwd_name, s_fwd[0]), deq(ws, fwd_name, s_fwd[1]), deq(gs, bwd_name, s_bwd[0])
        b = np32(layer.bias).astype(np.float64)
        assert y.dtype == dtype and y.shape == (2, 8, 32)
        assert_gemm_close(y.reshape(-1, 32), xq @ wq.T + b, xq, wq.T, EPS[dtype])
        assert_gemm_close(x.grad.reshape(-1, 48), gq @ wq, gq, wq, EPS[dtype])
        assert_gemm_close(layer.weight.grad, gq.T @ xq, gq.T, xq, EPS[dtype])
        bias_grad = np32(g).astype(np.float64).reshape(-1, 32).sum(0)
        np.testing.assert_allclose(np32(layer.bias.grad), bias_grad, rtol=EPS[dtype] * 16, atol=1e-9)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=8), Float8CurrentScaling(),
                                    DelayedScaling(fp8_format=Format.E4M3),
                                    Float8CurrentScaling(use_power_2_scales=True)])
def test_sqnr_against_float64_linear(recipe):
    torch.manual_seed(2)
    layer = te.Linear(256, 128)
    for step in range(3):
        x = torch.randn(64, 256, requires_grad=True)
        g = torch.randn(64, 128)
        layer.zero_grad()
        with te.autocast(recipe=recipe):
            y = layer(x)
        y.backward(g)
    x64, w64, g64 = x.detach().double(), layer.weight.detach().double(), g.double()
    y64 = x64 @ w64.T + layer.bias.detach().double()
    # E5M2 alone gives a Gaussian only ~25.5 dB (2 mantissa bits), so gradients cast to E5M2 get a lower floor.
    bwd_floor = 25 if recipe.fp8_format.value.bwd == "e4m3" else 23
    for got, want, floor in ((y, y64, 25), (x.grad, g64 @ w64, bwd_floor), (layer.weight.grad, g64.T @ x64, bwd_floor)):
        db = sqnr_db(want.numpy(), got.detach().double().numpy())
        assert db >= floor, db


def test_init_is_transformer_engines():
    """Transformer Engine's default: weight ~ normal(0, 0.023) drawn from the default generator, bias zeros."""
    torch.manual_seed(3)
    ours = te.Linear(40, 24)
    torch.manual_seed(3)
    want = torch.empty(24, 40).normal_(mean=0.0, std=0.023)
    assert torch.equal(ours.weight, want) and torch.equal(ours.bias, torch.zeros(24))
    custom = te.Linear(8, 16, init_method=lambda w: torch.nn.init.constant_(w, 0.5))
    assert torch.equal(custom.weight, torch.full((16, 8), 0.5))


def test_outside_autocast_bit_identical_to_nn_linear():
    ours = te.Linear(40, 24)
    theirs = torch.nn.Linear(40, 24)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    with torch.no_grad():
        ours.bias.uniform_(-1, 1)
        theirs.bias.copy_(ours.bias)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 5, 40, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    for ctx in (None, te.autocast(enabled=False), te.autocast(enabled=False, recipe=Float8CurrentScaling())):
        x.grad = x2.grad = None
        ours.zero_grad()
        theirs.zero_grad()
        if ctx is None:
            y = ours(x)
        else:
            with ctx:
                y = ours(x)
        y.square().sum().backward()
        theirs(x2).square().sum().backward()
        assert torch.equal(y, theirs(x2))
        assert torch.equal(x.grad, x2.grad)
        assert torch.equal(ours.weight.grad, theirs.weight.grad) and torch.equal(ours.bias.grad, theirs.bias.grad)
    assert ours.fp8_meta["scaling_fwd"] is None  # nothing registered without an enabled autocast


def test_params_dtype_device_and_no_bias():
    layer = te.Linear(32, 16, bias=False, params_dtype=torch.bfloat16, device="cpu")
    assert layer.weight.dtype == torch.bfloat16 and layer.bias is None and layer.weight.shape == (16, 32)
    with te.autocast():
        y = layer(torch.randn(16, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="disagree"):
        te.Linear(4, 4, params_dtype=torch.float16, dtype=torch.bfloat16)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_override_linear_precision_runs_that_gemm_in_high_precision(index):
    flags = [False, False, False]
    flags[index] = True
    recipe = DelayedScaling(amax_history_len=2, override_linear_precision=tuple(flags))
    torch.manual_seed(4)
    layer = te.Linear(32, 16)
    plain = torch.nn.Linear(32, 16)
    plain.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(8, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(8, 16)
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.backward(g)
    y2 = plain(x2)
    y2.backward(g)
    results = [(y, y2), (x.grad, x2.grad), (layer.weight.grad, plain.weight.grad)]
    for i, (got, want) in enumerate(results):
        if i == index:
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)  # high precision
        else:
            assert not torch.allclose(got, want, rtol=1e-4, atol=1e-4)  # FP8: visibly quantized


def test_all_overrides_leave_state_untouched():
    recipe = DelayedScaling(amax_history_len=2, override_linear_precision=(True, True, True))
    layer = te.Linear(16, 16)
    with te.autocast(recipe=recipe):
        layer(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert layer.fp8_meta["scaling_fwd"].amax_history.abs().sum() == 0
    assert layer.fp8_meta["scaling_fwd"].scale.tolist() == [1.0, 1.0, 1.0]


def test_fp8_input_is_saved_not_the_high_precision_one():
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel() * t.element_size()))
        return t

    layer = te.Linear(64, 64, params_dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
            layer(x)
    dtypes = [d for d, _ in saved]
    assert dtypes.count(torch.float8_e4m3fn) == 2  # FP8 input and FP8 weight
    assert torch.bfloat16 not in dtypes


def test_is_first_microbatch_caches_the_weight():
    recipe = DelayedScaling(amax_history_len=4)
    layer = te.Linear(16, 16)
    x = torch.randn(8, 16)
    with te.autocast(recipe=recipe):
        y1 = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(2.0)  # a cached FP8 weight ignores this
        y2 = layer(x, is_first_microbatch=False)
    assert torch.equal(y1, y2)
    hist = layer.fp8_meta["scaling_fwd"].amax_history
    assert hist[-1, 1] == ref.amax(np32(layer.weight) / 2)  # only the first call recorded the weight
    with te.autocast(recipe=recipe):
        layer(x, is_first_microbatch=False)  # the cache stays until the next first microbatch
        staging = layer.fp8_meta["scaling_fwd"].amax_history[0]
        assert staging[0] == ref.amax(np32(x)) and staging[1] == 0  # no weight cast, nothing recorded
        layer(x)  # None casts again
        assert staging[1] == ref.amax(np32(layer.weight))


def test_weight_slot_of_cached_microbatch_does_not_roll():
    recipe = DelayedScaling(amax_history_len=3)
    layer = te.Linear(16, 16)
    x = torch.randn(8, 16)
    with te.autocast(recipe=recipe):
        layer(x, is_first_microbatch=True)
    with te.autocast(recipe=recipe):
        layer(x, is_first_microbatch=False)
    hist = layer.fp8_meta["scaling_fwd"].amax_history
    assert hist[:, 0].tolist() == [0, ref.amax(np32(x)), ref.amax(np32(x))]  # input rolled twice
    assert hist[:, 1].tolist() == [0, 0, ref.amax(np32(layer.weight))]  # weight rolled once


def test_leading_dims_and_empty_batch():
    layer = te.Linear(16, 32)
    for shape in [(16,), (3, 16), (2, 3, 4, 16), (0, 16)]:
        with te.autocast(recipe=Float8CurrentScaling()):
            y = layer(torch.randn(shape))
        assert y.shape == shape[:-1] + (32,)


def test_nan_and_inf_activations_never_break_scales():
    recipe = DelayedScaling(amax_history_len=2)
    layer = te.Linear(16, 16)
    for bad in [math.inf, math.nan, -math.inf, 1.0]:
        x = torch.randn(4, 16, requires_grad=True)
        x.data[0, 0] = bad
        with te.autocast(recipe=recipe):
            y = layer(x)
        y.backward(torch.full_like(y, bad))
        for name in ("scaling_fwd", "scaling_bwd"):
            scale = layer.fp8_meta[name].scale
            assert torch.isfinite(scale).all() and (scale > 0).all(), (bad, name, scale)


def test_mixed_dtypes_and_bad_inputs_get_clear_errors():
    layer = te.Linear(16, 16)
    with te.autocast():
        with pytest.raises(TypeError, match="input dtype torch.bfloat16 does not match weight dtype torch.float32"):
            layer(torch.randn(4, 16, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="in_features=16"):
            layer(torch.randn(4, 15))
        with pytest.raises(TypeError, match="floating"):
            layer(torch.ones(4, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="recipe"):
        with te.autocast(recipe="delayed"):
            pass


def test_torch_autocast_casts_operands():
    layer = te.Linear(32, 16)
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(recipe=Float8CurrentScaling()):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32


def test_cuda_shape_rule_names_the_padding():
    """Unaligned shapes no longer raise on CUDA (issue 16): `check_cuda_shape` names what the GEMMs zero-pad."""
    from fp8kit.pytorch.gemm import check_cuda_shape

    assert check_cuda_shape(16, 32, 64) == []
    padded = " ".join(check_cuda_shape(12, 20, 24))
    assert "leading dimensions (12" in padded and "in_features (20)" in padded and "out_features (24)" in padded


def test_cpu_takes_any_shape():
    layer = te.Linear(5, 3)
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        y = layer(torch.randn(7, 5))
    assert y.shape == (7, 3)


@pytest.mark.cuda
def test_cuda_unaligned_shape_runs_padded():
    """K = 20 and N = 24 are zero-padded to multiples of 16 (with a warning): the FP8 layer runs and matches the
    CPU emulation closely."""
    torch.manual_seed(1)
    cpu = te.Linear(20, 24, params_dtype=torch.bfloat16)
    gpu = te.Linear(20, 24, device="cuda", params_dtype=torch.bfloat16)
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(12, 20, dtype=torch.bfloat16)
    outs = []
    for layer, dev in ((cpu, "cpu"), (gpu, "cuda")):
        with te.autocast(recipe=Float8CurrentScaling()):
            outs.append(layer(x.to(dev)).detach().float().cpu())
    assert outs[1].shape == (12, 24)
    assert sqnr_db(outs[0].double().numpy(), outs[1].double().numpy()) > 40


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()])
def test_cuda_linear_matches_cpu_state_and_float64(recipe):
    torch.manual_seed(5)
    cpu = te.Linear(64, 32, params_dtype=torch.bfloat16)
    gpu = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    for _ in range(3):
        x = torch.randn(32, 64, dtype=torch.bfloat16)
        # dy is given, not computed from y: fprop accumulates fast on the GPU, so a dy made from y could differ by
        # an ulp between the devices and move the backward amax; with the same dy every scale must match bit for bit
        dy = torch.randn(32, 32, dtype=torch.bfloat16)
        outs = []
        for layer, dev in ((cpu, "cpu"), (gpu, "cuda")):
            xi = x.to(dev).requires_grad_()
            with te.autocast(recipe=recipe):
                y = layer(xi)
            y.backward(dy.to(dev))
            outs.append(y.detach().float().cpu())
        assert sqnr_db(outs[0].double().numpy(), outs[1].double().numpy()) > 40
    if isinstance(recipe, DelayedScaling):
        for name in ("scaling_fwd", "scaling_bwd"):
            assert torch.equal(cpu.fp8_meta[name].scale, gpu.fp8_meta[name].scale.cpu())


def test_saved_bytes_at_most_055_of_nn_linear_bf16():
    def saved_bytes(module, x, ctx):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            module(x)
        return total[0]

    import contextlib

    x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    ours = te.Linear(256, 256, params_dtype=torch.bfloat16)
    plain = torch.nn.Linear(256, 256, dtype=torch.bfloat16)
    for recipe in (DelayedScaling(amax_history_len=4), Float8CurrentScaling()):
        ratio = saved_bytes(ours, x, te.autocast(recipe=recipe)) / saved_bytes(plain, x, contextlib.nullcontext())
        assert ratio <= 0.55, ratio
