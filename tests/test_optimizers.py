"""fp8kit.pytorch.optimizers: FusedAdam against torch.optim.AdamW / Adam (fused) run on float32 master copies, the FP8
parameters against tests/reference.py's cast of those masters, bias_correction=False against float64 NumPy, FusedSGD
against torch.optim.SGD(fused=True); checkpoints and copies resume exactly; unsupported options and bad input raise."""

import copy
import io

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch.optimizers import FusedAdam, FusedSGD
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref
from linear_helpers import np32

RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}


def make_model(recipe, dtype=torch.float32, seed=0, preserve=False):
    torch.manual_seed(seed)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=preserve):
        return torch.nn.Sequential(te.Linear(32, 48, params_dtype=dtype), torch.nn.GELU(),
                                   te.Linear(48, 16, params_dtype=dtype))


def backward(model, recipe, gen, dtype):
    x = (torch.randn(8, 32, generator=gen) * 2).to(dtype)
    with te.autocast(recipe=recipe):
        loss = model(x).float().square().mean()
    loss.backward()
    return loss.item()


def values(p) -> torch.Tensor:
    return p.dequantize() if isinstance(p, te.Float8Tensor) else p.detach()


def fp8_bytes(p) -> np.ndarray:
    assert p._data.dtype == torch.uint8 and p._fp8_dtype == te.DType.kFloat8E4M3  # Transformer Engine's layout
    return p._data.contiguous().numpy()


def expected_fp8(p, master: torch.Tensor, recipe) -> np.ndarray:
    """The reference cast of the master: the delayed weight slot's scale, or the master's own current scale."""
    if isinstance(recipe, DelayedScaling):
        scale = p._quantizer.scale.item()
    else:
        scale = ref.current_scale(ref.amax(np32(master)), 448.0)
    return ref.cast(np32(master), "e4m3", scale)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fused_adam_equals_torch_adam_on_float32_masters(recipe_name, dtype, adam_w_mode):
    recipe = RECIPES[recipe_name]
    model = make_model(recipe, dtype, preserve=True)
    params = list(model.parameters())
    hp = {id(p): p.get_high_precision_init_val() for p in params if isinstance(p, te.Float8Tensor)}
    # the masters start from the high-precision initial values (FP8 weights) or the parameters (biases)
    masters = [(hp[id(p)] if id(p) in hp else p.detach()).float().clone().requires_grad_() for p in params]
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt = FusedAdam(params, master_weights=True, adam_w_mode=adam_w_mode, **kw)
    torch_opt = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(masters, fused=True, **kw)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        backward(model, recipe, gen, dtype)
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        amax_before = {id(p): p._quantizer.amax.item() for p in params if isinstance(recipe, DelayedScaling)
                       and isinstance(p, te.Float8Tensor)}
        torch_opt.step()
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in params)
        for p, m in zip(params, masters):
            state = opt.state[p]
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[name], torch_opt.state[m][name]), (step, name)
            if isinstance(p, te.Float8Tensor):
                assert torch.equal(state["master_param"], m.detach())
                want, inv = expected_fp8(p, m, recipe)
                assert np.array_equal(fp8_bytes(p), want) and p._scale_inv.item() == inv
                if isinstance(recipe, DelayedScaling):  # the weight's amax is recorded by its quantization
                    assert p._quantizer.amax.item() == max(amax_before[id(p)], ref.amax(np32(m)))
            elif dtype == torch.float32:
                assert "master_param" not in state and torch.equal(p.detach(), m.detach())
            else:
                assert torch.equal(state["master_param"], m.detach())
                assert torch.equal(p.detach(), m.detach().to(dtype))


def test_masters_start_from_the_dequantized_weight_without_preserved_values():
    recipe = RECIPES["current"]
    model = make_model(recipe)
    opt = FusedAdam(model.parameters(), master_weights=True)
    w = model[0].weight
    opt.initialize_state(w)
    assert torch.equal(opt.get_unscaled_state(w, "master_param"), w.dequantize(dtype=torch.float32))
    # Transformer Engine's way of seeding them (its FSDP2 example)
    value = torch.randn(w.shape)
    opt.set_scaled_state(w, "master_param", value)
    assert torch.equal(opt.state[w]["master_param"], value)
    with pytest.raises(ValueError, match="local shape"):
        opt.set_scaled_state(w, "master_param", torch.randn(3, 3))
    with pytest.raises(ValueError, match="state_name"):
        opt.set_scaled_state(w, "momentum", value)
    with pytest.raises(ValueError, match="no master weight"):
        opt.set_scaled_state(model[0].bias, "master_param", torch.zeros(48))


def test_bf16_parameters_without_master_weights_step_in_float32():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8).bfloat16()
    params = list(layer.parameters())
    work = [p.detach().float().clone().requires_grad_() for p in params]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.01)
    torch_opt = torch.optim.AdamW(work, lr=1e-2, weight_decay=0.01, fused=True)
    for _ in range(3):
        layer(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().sum().backward()
        with torch.no_grad():
            for p, w in zip(params, work):
                w.copy_(p.float())  # the working copy is the bf16 value, each step
                w.grad = p.grad.float()
        torch_opt.step()
        opt.step()
        opt.zero_grad()
        for p, w in zip(params, work):
            assert "master_param" not in opt.state[p]
            assert torch.equal(p.detach(), w.detach().bfloat16())


def test_bias_correction_off_against_float64():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.05
    opt = FusedAdam([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, bias_correction=False)
    w = p.detach().double().numpy().copy()
    m, v = np.zeros(64), np.zeros(64)
    for _ in range(4):
        g = torch.randn(64)
        p.grad = g.clone()
        opt.step()
        g64 = g.double().numpy()
        m = b1 * m + (1 - b1) * g64
        v = b2 * v + (1 - b2) * g64 * g64
        w = w - lr * (m / (np.sqrt(v) + eps) + wd * w)  # no division by 1 - beta**step
    np.testing.assert_allclose(p.detach().double().numpy(), w, rtol=1e-5, atol=1e-6)
    q = torch.nn.Parameter(torch.zeros(4))
    q.grad = torch.ones(4)
    FusedAdam([q], lr=1.0, bias_correction=True).step()
    assert torch.allclose(q, torch.full((4,), -1.0))  # with bias correction the first step is lr * sign(g)


def test_decoupled_grad_reads_decoupled_grad():
    recipe = RECIPES["delayed"]
    runs = []
    for decoupled in (False, True):
        model = make_model(recipe, seed=3)
        opt = FusedAdam(model.parameters(), lr=1e-2, master_weights=True, use_decoupled_grad=decoupled)
        gen = torch.Generator().manual_seed(4)
        for _ in range(2):
            backward(model, recipe, gen, torch.float32)
            if decoupled:
                for p in model.parameters():
                    p.decoupled_grad, p.grad = p.grad.float(), None
            opt.step()
            opt.zero_grad()
            if decoupled:
                assert all(p.decoupled_grad is None for p in model.parameters())
        runs.append(model)
    for a, b in zip(*(m.parameters() for m in runs)):
        assert torch.equal(values(a), values(b))
    # a step with the gradients in .grad only: nothing to update under use_decoupled_grad
    model = make_model(recipe, seed=3)
    opt = FusedAdam(model.parameters(), master_weights=True, use_decoupled_grad=True)
    backward(model, recipe, torch.Generator().manual_seed(4), torch.float32)
    before = [values(p).clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, values(b)) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_checkpoint_and_copies_resume_exactly(recipe_name):
    recipe = RECIPES[recipe_name]
    dtype = torch.bfloat16  # nominally-bf16 FP8 weights: torch's load_state_dict would round the masters to bf16

    def train(model, opt, seed, steps):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            backward(model, recipe, gen, dtype)
            opt.step()
            opt.zero_grad()

    model = make_model(recipe, dtype)
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, master_weights=True)
    train(model, opt, 0, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = make_model(recipe, dtype, seed=9)
    resumed.load_state_dict(saved["model"])
    resumed_opt = FusedAdam(resumed.parameters(), lr=1e-2, weight_decay=0.01, master_weights=True)
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.state[resumed[0].weight]["master_param"].dtype == torch.float32
    twin, twin_opt = copy.deepcopy((model, opt))
    for m, o in ((model, opt), (resumed, resumed_opt), (twin, twin_opt)):
        train(m, o, 1, 2)
    for other, other_opt in ((resumed, resumed_opt), (twin, twin_opt)):
        for a, b in zip(model.parameters(), other.parameters()):
            if isinstance(a, te.Float8Tensor):
                assert np.array_equal(fp8_bytes(a), fp8_bytes(b)) and torch.equal(a._scale_inv, b._scale_inv)
            else:
                assert torch.equal(a, b)
            for name, value in opt.state[a].items():
                assert torch.equal(value, other_opt.state[b][name]), name
        assert other_opt.param_groups[0]["step"] == opt.param_groups[0]["step"] == 4


def test_unsupported_options_and_bad_input_raise():
    model = make_model(RECIPES["current"])
    params = list(model.parameters())
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdam(params, amsgrad=True)
    for kwargs, needle in (({"master_weights": True, "master_weight_dtype": torch.bfloat16}, "master_weight_dtype"),
                           ({"master_weights": True, "exp_avg_dtype": torch.float64}, "exp_avg_dtype"),
                           ({"master_weights": True, "exp_avg_sq_dtype": torch.int8}, "exp_avg_sq_dtype"),
                           ({"capturable": True, "master_weights": True, "master_weight_dtype": torch.float16},
                            "float32 master"),
                           ({"capturable": True, "exp_avg_dtype": torch.bfloat16}, "both"),
                           ({"capturable": True, "master_weights": True, "store_param_remainders": True},
                            "remainders")):
        with pytest.raises(ValueError, match=needle):
            FusedAdam(params, **kwargs)
    with pytest.raises(ValueError, match="capturable"):  # FP8 weights: the write-back cannot be captured
        for p in params:
            p.grad = torch.zeros(p.shape)
        FusedAdam(params, capturable=True, master_weights=True).step()
    for p in params:
        p.grad = None
    with pytest.raises(ValueError, match="master_weights=True"):
        FusedAdam(params)  # FP8 weights without master weights: never a silent no-op
    for kwargs, needle in (({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, r"betas\[1\]"), ({"eps": float("nan")},
                           "eps"), ({"weight_decay": -0.1}, "weight_decay"), ({"betas": 0.9}, "betas")):
        with pytest.raises(ValueError, match=needle):
            FusedAdam(params, master_weights=True, **kwargs)
    with pytest.raises(TypeError, match="float64"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    opt = FusedAdam(params, master_weights=True, use_decoupled_grad=True)
    with pytest.raises(NotImplementedError, match="grad_scaler"):
        opt.step(grad_scaler=object())
    params[1].decoupled_grad = torch.zeros(3)
    with pytest.raises(ValueError, match="gradient of shape"):
        opt.step()
    with pytest.raises(TypeError, match="quantized"):
        FusedSGD(params, lr=0.1)


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("kw", [dict(momentum=0.9, weight_decay=0.01), dict(momentum=0.9, nesterov=True),
                                dict(momentum=0.5, dampening=0.1), dict()])
def test_fused_sgd_equals_torch_sgd(kw, dtype):
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dtype)
    b = copy.deepcopy(a)
    opt = FusedSGD(a.parameters(), lr=0.05, **kw)
    torch_opt = torch.optim.SGD(b.parameters(), lr=0.05, fused=True, **kw)
    for step in range(3):
        x = torch.randn(8, 16, dtype=dtype)
        for model in (a, b):
            model(x).float().square().mean().backward()
        if step == 1:  # a parameter without a gradient this step starts its momentum later (a separate launch)
            a[0].bias.grad = b[0].bias.grad = None
        opt.step()
        torch_opt.step()
        opt.zero_grad()
        torch_opt.zero_grad()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    assert FusedSGD(a.parameters(), lr=0.1).state_dict()["param_groups"][0]["lr"] == 0.1
    with pytest.raises(NotImplementedError, match="wd_after_momentum"):
        FusedSGD(a.parameters(), lr=0.1, wd_after_momentum=True)
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD(a.parameters(), lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match="lr is required"):
        FusedSGD(a.parameters())


def test_main_grad_and_decoupled_grad_as_in_the_te_example():
    """The gradient flow of Transformer Engine's quantized_model_init example on Linear layers: fuse_wgrad_accumulation
    writes dW into float32 `main_grad`, the other gradients are copied there, FusedAdam reads `decoupled_grad`. The
    FP8 weights end equal to those of the plain `.grad` path."""
    recipe = RECIPES["current"]
    runs = []
    for fused in (False, True):
        torch.manual_seed(5)
        with te.quantized_model_init(recipe=recipe):
            model = torch.nn.Sequential(te.Linear(32, 48, fuse_wgrad_accumulation=fused), torch.nn.GELU(),
                                        te.Linear(48, 16, fuse_wgrad_accumulation=fused))
        params = list(model.parameters())
        if fused:
            for p in params:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        opt = FusedAdam(params, lr=1e-2, master_weights=True, use_decoupled_grad=fused)
        gen = torch.Generator().manual_seed(6)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            if fused:
                for p in params:
                    p.main_grad.zero_()
            backward(model, recipe, gen, torch.float32)
            if fused:
                assert model[0].weight.grad is None and model[0].weight.main_grad.abs().sum() > 0
                for p in params:
                    if p.grad is not None:
                        p.main_grad.copy_(p.grad)
                        p.grad = None
                    p.decoupled_grad = p.main_grad
            opt.step()
        runs.append(params)
    for a, b in zip(*runs):
        assert torch.equal(values(a), values(b))


def _sgd64(w, g, buf, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    """One SGD step in float64 (Transformer Engine's kernel order: weight decay, momentum, Nesterov); buf None on the
    first step."""
    g = g + weight_decay * w
    if momentum:
        buf = g if buf is None else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return w - lr * g, buf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [dict(momentum=0.9, weight_decay=0.01), dict(momentum=0.9, nesterov=True), dict()])
def test_fused_sgd_steps_16_bit_parameters_in_float32(kw, dtype):
    """Each step from the current bf16/fp16 parameter and momentum equals the float64 update rounded once to the
    dtype (a float32 computation may land one ulp off where the float64 value sits near a rounding boundary); small
    updates are applied, not lost."""
    torch.manual_seed(1)
    p = torch.nn.Parameter((torch.rand(4096) + 0.5).to(dtype))
    opt = FusedSGD([p], lr=1e-2, **kw)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for _ in range(3):
        w64 = p.detach().double()
        buf = opt.state[p].get("momentum_buffer")
        buf64 = None if buf is None else buf.double()
        p.grad = torch.rand(4096).to(dtype)
        want_w, want_buf = _sgd64(w64, p.grad.double(), buf64, 1e-2, **kw)
        opt.step()
        for got, want in [(p.detach(), want_w)] + ([(opt.state[p]["momentum_buffer"], want_buf)] if kw else []):
            assert got.dtype == dtype
            rounded = want.to(dtype).double()
            off = got.double() != rounded
            assert off.float().mean() < 0.01
            assert torch.all((got.double() - want).abs()[off] <= ulp * want.abs()[off])
        assert (want_w.to(dtype).double() != w64).float().mean() > 0.3  # most updates are above half an ulp
