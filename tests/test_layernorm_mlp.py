"""fp8kit.pytorch.LayerNormMLP: Transformer Engine's activations (float64 formulas), high precision against torch
ops, FP8 bit for bit against the same MLP built from fp8kit's separate modules, the slot layout against
tests/reference.py, weight-gradient options, recompute, copies and errors."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8kit.pytorch as te
from fp8kit.pytorch.modules.activation import ACTIVATIONS, activation, activation_saving_input
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref
from linear_helpers import np32
from mlp_helpers import ALL, GATED, Composition, mlp_states, te_formula64, torch_activation

DELAYED = DelayedScaling(amax_history_len=3)
CURRENT = Float8CurrentScaling()


def inputs(steps, shape=(4, 3, 32), dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * 2.0 ** (s % 3 - 1)).to(dtype) for s in range(steps)]


def bitwise_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.is_floating_point()
                                                                       else a, b.view(torch.uint8)
                                                                       if b.is_floating_point() else b)


# ---- activations ---------------------------------------------------------------------------------------------

def test_the_activation_list_is_transformer_engines():
    assert set(ACTIVATIONS) == set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_activation_equals_transformer_engines_formula_in_float64(name):
    torch.manual_seed(0)
    x = torch.randn(64, 24) * 3
    x[0, :3] = torch.tensor([0.0, 7.5, -8.0])  # around clamped_swiglu's limit too
    got = activation(name, x)
    want = te_formula64(name, x.double().numpy())
    assert got.shape == want.shape == ((64, 12) if name in GATED else (64, 24))
    # float32 rounding of the terms (tanh's 1 + t cancels for negative x): a few ulps of |a| * |b|
    a, b = (x.chunk(2, -1) if name in GATED else (x, torch.ones(())))
    tol = 1e-6 * (1 + a.abs().double().numpy()) * (1 + b.abs().double().numpy())
    assert np.all(np.abs(got.double().numpy() - want) <= tol), np.max(np.abs(got.double().numpy() - want) / tol)
    if name in ("gelu", "geglu"):  # the tanh approximation, not torch's default erf GELU
        erf = F.gelu(a.double()).numpy() * b.double().numpy()
        assert np.max(np.abs(erf - want) / tol) > 10
    if name in GATED:  # the first half is gated: swapping the halves gives something else
        swapped = te_formula64(name, torch.cat(x.chunk(2, -1)[::-1], -1).double().numpy())
        assert not np.allclose(got.double().numpy(), swapped, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ALL)
def test_activation_gradient_equals_float64_autograd_of_the_formula(name):
    torch.manual_seed(1)
    x = (torch.randn(32, 16) * 2).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    g = torch.randn(32, 8 if name in GATED else 16)
    activation_saving_input(name, x).backward(g)
    # the formula again, in float64 torch ops, for autograd
    want = torch_activation(name, x64)
    want.backward(g.double())
    np.testing.assert_allclose(x.grad.double().numpy(), x64.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ALL)
def test_saving_input_is_bit_identical_to_plain_ops_and_saves_only_the_input(name, dtype):
    torch.manual_seed(2)
    x = (torch.randn(16, 32) * 3).to(dtype).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(16, 16 if name in GATED else 32).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = activation_saving_input(name, x)
    y2 = torch_activation(name, x2)
    y.backward(g)
    y2.backward(g)
    assert bitwise_equal(y, y2) and bitwise_equal(x.grad, x2.grad)
    assert len(saved) == 1 and saved[0] is x


# ---- high precision -------------------------------------------------------------------------------------------

def _reference_forward(mlp, x, name):
    """LayerNormMLP outside autocast, written with torch ops."""
    gamma = mlp.layer_norm_weight + 1 if mlp.zero_centered_gamma else mlp.layer_norm_weight
    if mlp.normalization == "LayerNorm":
        h = F.layer_norm(x, (mlp.hidden_size,), gamma, mlp.layer_norm_bias, mlp.eps)
    else:
        h = F.rms_norm(x, (mlp.hidden_size,), gamma, mlp.eps)
    a = torch_activation(name, F.linear(h, mlp.fc1_weight, mlp.fc1_bias))
    return F.linear(a, mlp.fc2_weight, None if mlp.return_bias else mlp.fc2_bias), h


@pytest.mark.parametrize("normalization,name,bias,zero_centered,return_bias", [
    ("LayerNorm", "gelu", True, False, False), ("RMSNorm", "swiglu", False, True, False),
    ("LayerNorm", "sreglu", True, True, True), ("RMSNorm", "qgelu", True, False, False),
])
def test_outside_autocast_equals_torch_ops_bit_for_bit(normalization, name, bias, zero_centered, return_bias):
    torch.manual_seed(3)
    mlp = te.LayerNormMLP(32, 48, normalization=normalization, activation=name, bias=bias,
                          zero_centered_gamma=zero_centered, return_bias=return_bias, return_layernorm_output=True)
    with torch.no_grad():
        for p in mlp.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, 5, 32) * 2
    g = torch.randn(2, 5, 32)
    for ctx in (None, te.autocast(enabled=False)):
        xa = x.clone().requires_grad_()
        mlp.zero_grad()
        if ctx is None:
            outs = mlp(xa)
        else:
            with ctx:
                outs = mlp(xa)
        outs[0].backward(g)
        got = [outs[0], outs[-1], xa.grad] + [p.grad for p in mlp.parameters()]
        xb = x.clone().requires_grad_()
        mlp.zero_grad()
        y, h = _reference_forward(mlp, xb, name)
        y.backward(g)
        want = [y, h, xb.grad] + [p.grad for p in mlp.parameters()]
        assert all(bitwise_equal(a, b) for a, b in zip(got, want))
        if return_bias:
            assert outs[1] is mlp.fc2_bias
    assert mlp.fp8_meta["scaling_fwd"] is None


# ---- FP8: the fused module equals the composition of fp8kit's modules ----------------------------------------

@pytest.mark.parametrize("recipe", [DELAYED, CURRENT, Float8CurrentScaling(backward_override="dequantized")],
                         ids=["delayed", "current", "current-dequantized-backward"])
@pytest.mark.parametrize("normalization,name,dtype", [
    ("LayerNorm", "gelu", torch.float32), ("RMSNorm", "swiglu", torch.float32),
    ("LayerNorm", "srelu", torch.bfloat16), ("RMSNorm", "qgeglu", torch.bfloat16),
])
def test_fp8_fused_is_bit_identical_to_the_composition(recipe, normalization, name, dtype):
    torch.manual_seed(4)
    mlp = te.LayerNormMLP(32, 48, normalization=normalization, activation=name, params_dtype=dtype)
    with torch.no_grad():
        for p in (mlp.layer_norm_weight, mlp.fc1_bias, mlp.fc2_bias):
            p.add_(torch.randn_like(p) * 0.1)
    comp = Composition(mlp)
    # another autocast key for the composition (reduce_amax changes nothing on one process): an update of one
    # model's key must not tidy up the other's states
    other = dataclasses.replace(recipe, reduce_amax=False) if recipe is DELAYED else recipe
    for step, x in enumerate(inputs(3, dtype=dtype)):
        g = torch.randn(x.shape).to(dtype) * 2.0 ** step
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            ya = mlp(xa)
        with te.autocast(recipe=other):
            yb = comp(xb)
        ya.backward(g)
        yb.backward(g)
        assert bitwise_equal(ya, yb), f"step {step}: output"
        assert bitwise_equal(xa.grad, xb.grad), f"step {step}: input gradient"
        for i, (a, b) in enumerate(zip([p.grad for p in mlp.parameters()], comp.fused_grads())):
            assert bitwise_equal(a, b), f"step {step}: gradient of parameter {i}"
        if recipe is DELAYED:
            for a, b in zip(mlp_states(mlp), comp.fused_states()):
                assert torch.equal(a, b), f"step {step}: {a} != {b}"
        mlp.zero_grad()
        comp.zero_grad()
    with torch.no_grad():
        y_hp = comp(x)
    assert not torch.equal(ya.detach(), y_hp), "the FP8 run looks like high precision"


def test_slot_layout_holds_the_reference_amaxes():
    """After each step the newest history row holds amax(norm output), amax(fc1 weight), 0, amax(activation output),
    amax(fc2 weight), 0 and backward amax(fc1 grad_output), 0, amax(grad of the output), 0; the scales follow
    tests/reference.py's update."""
    torch.manual_seed(5)
    recipe = DelayedScaling(amax_history_len=2, margin=1)
    mlp = te.LayerNormMLP(32, 48, activation="geglu", return_layernorm_output=True)
    fwd_ref = ref.DelayedState(2, 6, 448.0, margin=1)
    bwd_ref = ref.DelayedState(2, 4, 57344.0, margin=1)
    for step, x in enumerate(inputs(3)):
        captured = {}

        def pack(t):  # the activation saves fc1's high-precision output: catch it and its gradient
            if t.dtype == torch.float32 and t.shape[-1] == 96:
                captured["fc1_out"] = t.detach().clone()
                t.register_hook(lambda grad: captured.__setitem__("fc1_grad", grad.detach().clone()))
            return t

        g = torch.randn(x.shape) * 3.0 ** step
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with te.autocast(recipe=recipe):
                y, ln_out = mlp(x.requires_grad_())
        y.backward(g)
        act_out = torch_activation("geglu", captured["fc1_out"])
        fwd_amax = [ref.amax(np32(ln_out)), ref.amax(np32(mlp.fc1_weight)), 0.0, ref.amax(np32(act_out)),
                    ref.amax(np32(mlp.fc2_weight)), 0.0]
        bwd_amax = [ref.amax(np32(captured["fc1_grad"])), 0.0, ref.amax(np32(g)), 0.0]
        for state, r, amaxes in ((mlp.fp8_meta["scaling_fwd"], fwd_ref, fwd_amax),
                                 (mlp.fp8_meta["scaling_bwd"], bwd_ref, bwd_amax)):
            assert state.amax_history[-1].tolist() == [float(a) for a in amaxes], f"step {step}"
            for slot, a in enumerate(amaxes):
                r.record(slot, a)
            r.update()
            np.testing.assert_array_equal(state.amax_history.numpy(), r.history)
            np.testing.assert_array_equal(state.scale.numpy(), r.scale)
        assert all(a > 0 for i, a in enumerate(fwd_amax) if i % 3 != 2) and bwd_amax[0] > 0


def test_parameters_init_and_gated_fc1_size():
    torch.manual_seed(6)
    mlp = te.LayerNormMLP(16, 24, activation="reglu")
    assert [n for n, _ in mlp.named_parameters()] == ["layer_norm_weight", "layer_norm_bias", "fc1_weight",
                                                      "fc1_bias", "fc2_weight", "fc2_bias"]
    assert mlp.fc1_weight.shape == (48, 16) and mlp.fc2_weight.shape == (16, 24)
    torch.manual_seed(6)
    w1 = torch.empty(48, 16).normal_(0.0, 0.023)
    w2 = torch.empty(16, 24).normal_(0.0, 0.023)
    assert torch.equal(mlp.fc1_weight, w1) and torch.equal(mlp.fc2_weight, w2)
    assert torch.equal(mlp.layer_norm_weight, torch.ones(16)) and not mlp.fc1_bias.any() and not mlp.fc2_bias.any()
    rms = te.LayerNormMLP(16, 24, normalization="RMSNorm", bias=False, zero_centered_gamma=True,
                          init_method=lambda w: torch.nn.init.constant_(w, 0.5),
                          output_layer_init_method=lambda w: torch.nn.init.constant_(w, -0.25))
    assert rms.layer_norm_bias is None and rms.fc1_bias is None and rms.fc2_bias is None
    assert not rms.layer_norm_weight.any() and (rms.fc1_weight == 0.5).all() and (rms.fc2_weight == -0.25).all()
    assert [n for n, _ in rms.named_parameters()] == ["layer_norm_weight", "fc1_weight", "fc2_weight"]


# ---- microbatches and weight-gradient options ---------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fuse_wgrad_accumulation_adds_float32_gradients_into_main_grad(recipe):
    torch.manual_seed(7)
    fused = te.LayerNormMLP(32, 48, fuse_wgrad_accumulation=True)
    plain = copy.deepcopy(fused)
    plain.fuse_wgrad_accumulation = False
    for w in (fused.fc1_weight, fused.fc2_weight):
        w.main_grad = torch.full(w.shape, 123.0)  # garbage the first microbatch overwrites
    for round_ in range(2):
        plain.zero_grad()
        for micro, x in enumerate(inputs(2, seed=10 + round_)):
            first = micro == 0
            for module in (fused, plain):
                with te.autocast(recipe=recipe):
                    y = module(x, is_first_microbatch=first)
                y.square().sum().backward()
        for wf, wp in ((fused.fc1_weight, plain.fc1_weight), (fused.fc2_weight, plain.fc2_weight)):
            assert wf.grad is None and wf.main_grad.dtype == torch.float32
            assert torch.equal(wf.main_grad, wp.grad)  # float32 sum of the two microbatches' gradients
        assert torch.equal(fused.fc1_bias.grad, plain.fc1_bias.grad)
        fused.zero_grad()


def test_is_first_microbatch_caches_both_fp8_weights():
    torch.manual_seed(8)
    mlp = te.LayerNormMLP(32, 48)
    x = inputs(1)[0]
    with te.autocast(recipe=DELAYED):
        y1 = mlp(x, is_first_microbatch=True)
    with torch.no_grad():
        mlp.fc1_weight.mul_(2.0)
        mlp.fc2_weight.mul_(2.0)
    with te.autocast(recipe=DELAYED):
        y2 = mlp(x, is_first_microbatch=False)
        staging = mlp.fp8_meta["scaling_fwd"].amax_history[0].clone()
    # the same scales are in use only if no update ran in between: compare with the cached weights' amaxes
    assert staging[1] == 0 and staging[4] == 0 and staging[0] > 0 and staging[3] > 0
    with te.autocast(recipe=DELAYED):
        mlp(x)
        staging = mlp.fp8_meta["scaling_fwd"].amax_history[0]
        assert staging[1] == ref.amax(np32(mlp.fc1_weight)) and staging[4] == ref.amax(np32(mlp.fc2_weight))
    assert not torch.equal(y1, 2 * y2)  # y2 used the cached (unscaled) weights, not the doubled ones
    assert y2.shape == y1.shape


def test_delay_wgrad_compute_leaves_both_weight_gradients_for_backward_dw():
    torch.manual_seed(9)
    delayed = te.LayerNormMLP(32, 48, delay_wgrad_compute=True)
    plain = copy.deepcopy(delayed)
    plain.wgrad_stores = None
    for module in (delayed, plain):
        with te.autocast(recipe=DELAYED):
            y = module(inputs(1)[0])
        y.sum().backward()
    assert delayed.fc1_weight.grad is None and delayed.fc2_weight.grad is None and delayed.need_backward_dw()
    assert torch.equal(delayed.fc2_bias.grad, plain.fc2_bias.grad)
    delayed.backward_dw()
    assert not delayed.need_backward_dw()
    assert torch.equal(delayed.fc1_weight.grad, plain.fc1_weight.grad)
    assert torch.equal(delayed.fc2_weight.grad, plain.fc2_weight.grad)


def test_stats_name_the_two_gemms():
    mlp = te.LayerNormMLP(32, 48)
    te.enable_stats(mlp)
    with te.autocast(recipe=CURRENT):
        mlp(inputs(1)[0].requires_grad_()).sum().backward()
    roles = {row["role"] for row in te.stats(mlp)}
    assert {"fc1.input", "fc1.weight", "fc1.grad_output", "fc2.input", "fc2.weight", "fc2.grad_output"} <= roles


# ---- errors -----------------------------------------------------------------------------------------------------

def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="activation must be one of .*got 'gelu2'"):
        te.LayerNormMLP(16, 32, activation="gelu2")
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm', got 'BatchNorm'"):
        te.LayerNormMLP(16, 32, normalization="BatchNorm")
    with pytest.raises(ValueError, match="ffn_hidden_size=32 is not divisible by the tensor-parallel size 3"):
        te.LayerNormMLP(16, 32, set_parallel_mode=True, tp_size=3)
    with pytest.raises(ValueError, match="ffn_hidden_size must be an int >= 0, got -1"):
        te.LayerNormMLP(16, -1)
    with pytest.raises(ValueError, match="takes no activation_params"):
        te.LayerNormMLP(16, 32, activation="gelu", activation_params={"limit": 3.0})
    with pytest.raises(ValueError, match="unknown activation_params"):
        te.LayerNormMLP(16, 32, activation="clamped_swiglu", activation_params={"beta": 3.0})
    mlp = te.LayerNormMLP(16, 32)
    with pytest.raises(ValueError, match="does not end with hidden_size=16"):
        mlp(torch.randn(4, 15))
    split = te.LayerNormMLP(16, 32, set_parallel_mode=True, tp_size=2)
    assert split.fc1_weight.shape == (16, 16) and split.fc2_weight.shape == (16, 16)
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        split(torch.randn(4, 16))


def test_clamped_swiglu_params_reach_the_module():
    torch.manual_seed(10)
    mlp = te.LayerNormMLP(16, 8, activation="clamped_swiglu",
                          activation_params={"limit": 0.5, "alpha": 1.0, "glu_linear_offset": 0.25})
    comp = Composition(mlp)
    x = inputs(1, shape=(6, 16))[0]
    with torch.no_grad():
        assert torch.equal(mlp(x), comp(x))
        default = Composition(te.LayerNormMLP(16, 8, activation="clamped_swiglu"))
        default.load_state_dict(comp.state_dict())
        assert not torch.equal(default(x), comp(x))


def test_calibration_computes_in_high_precision_and_records_the_composition_amaxes():
    torch.manual_seed(11)
    mlp = te.LayerNormMLP(32, 48, activation="swiglu")
    comp = Composition(mlp)
    x = inputs(1)[0]
    with te.autocast(enabled=False, calibrating=True, recipe=DELAYED):
        ya = mlp(x.clone().requires_grad_())
    with te.autocast(enabled=False, calibrating=True, recipe=dataclasses.replace(DELAYED, reduce_amax=False)):
        yb = comp(x.clone().requires_grad_())
    ya.sum().backward()
    yb.sum().backward()
    with torch.no_grad():
        assert bitwise_equal(ya, _reference_forward(mlp, x, "swiglu")[0])
    assert bitwise_equal(ya, yb)
    for a, b in zip(mlp_states(mlp), comp.fused_states()):
        assert torch.equal(a, b)
    assert mlp.fp8_meta["scaling_fwd"].amax_history[-1, 3] > 0 and mlp.fp8_meta["scaling_bwd"].amax_history[-1, 0] > 0


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fp8_weights_equal_the_composition_built_the_same_way(recipe):
    """Under quantized_model_init fc1_weight and fc2_weight are Float8Tensor parameters (slots 1 and 4 under
    delayed scaling); the module equals norm + te.Linear + activation + te.Linear created the same way."""
    other = dataclasses.replace(recipe, reduce_amax=False) if recipe is DELAYED else recipe
    torch.manual_seed(12)
    with te.quantized_model_init(recipe=recipe):
        mlp = te.LayerNormMLP(32, 48, activation="srelu")
    torch.manual_seed(12)
    with te.quantized_model_init(recipe=other):
        norm, fc1, fc2 = te.LayerNorm(32), te.Linear(32, 48), te.Linear(48, 32)
    assert isinstance(mlp.fc1_weight, te.Float8Tensor) and isinstance(mlp.fc2_weight, te.Float8Tensor)
    assert not isinstance(mlp.layer_norm_weight, te.Float8Tensor) and not isinstance(mlp.fc1_bias, te.Float8Tensor)
    for a, b in ((mlp.fc1_weight, fc1.weight), (mlp.fc2_weight, fc2.weight)):
        assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8))
    opt_a = torch.optim.SGD(mlp.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(list(norm.parameters()) + list(fc1.parameters()) + list(fc2.parameters()), lr=0.5)
    for step, x in enumerate(inputs(2)):
        with te.autocast(recipe=recipe):
            ya = mlp(x)
        with te.autocast(recipe=other):
            yb = fc2(torch_activation("srelu", fc1(norm(x))))
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert bitwise_equal(ya, yb), f"step {step}"
        opt_a.step()  # the FP8 weights are requantized in place
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        for a, b in ((mlp.fc1_weight, fc1.weight), (mlp.fc2_weight, fc2.weight)):
            assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8)), f"step {step}"


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_cuda_fused_is_bit_identical_to_the_composition(recipe):
    torch.manual_seed(13)
    mlp = te.LayerNormMLP(64, 128, activation="swiglu", params_dtype=torch.bfloat16, device="cuda")
    comp = Composition(mlp).cuda()
    other = dataclasses.replace(recipe, reduce_amax=False) if recipe is DELAYED else recipe
    for step, x in enumerate(inputs(2, shape=(16, 2, 64), dtype=torch.bfloat16)):
        x = x.cuda()
        g = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            ya = mlp(xa)
        with te.autocast(recipe=other):
            yb = comp(xb)
        ya.backward(g)
        yb.backward(g)
        assert bitwise_equal(ya, yb) and bitwise_equal(xa.grad, xb.grad), f"step {step}"
        for a, b in zip([p.grad for p in mlp.parameters()], comp.fused_grads()):
            assert bitwise_equal(a, b), f"step {step}"
        if recipe is DELAYED:
            for a, b in zip(mlp_states(mlp), comp.fused_states()):
                assert torch.equal(a, b), f"step {step}"
        mlp.zero_grad()
        comp.zero_grad()
