"""FusedAdam's narrower states (exp_avg_dtype / exp_avg_sq_dtype bf16, fp16, uint8; fp16 master weights;
store_param_remainders) and capturable mode, against Adam written here in float64 from the optimizer's own
(unscaled) states before each step: every stored state is the float64 step rounded once to its storage."""

import copy

import pytest
import torch

from fp8kit.pytorch.optimizers import FusedAdam

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.01
NAMES = ("exp_avg", "exp_avg_sq", "master_param")


def adam64(w, g, m, v, step, adam_w=True):
    """Transformer Engine's Adam/AdamW step in float64 (bias correction on)."""
    b1, b2 = BETAS
    if not adam_w:
        g = g + WD * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + EPS)
    if adam_w:
        update = update + WD * w
    return w - LR * update, m, v


def storage_error(dtype, want, other=None):
    """The largest error of storing float64 `want` once in `dtype` (scaled dtypes: by the absmax), plus float32."""
    absmax = want.abs().max()
    rel = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
           torch.uint8: 2.0 ** -4}[dtype]
    floor = {torch.float16: absmax * 2.0 ** -24 / 32752 * 65504, torch.uint8: absmax / 448 * 2.0 ** -10}
    return rel * want.abs() + floor.get(dtype, 0.0) + 1e-6 * absmax


def params(dtype):
    torch.manual_seed(0)
    return [torch.nn.Parameter((torch.randn(257) * 2).to(dtype)), torch.nn.Parameter(torch.randn(16, 8).to(dtype))]


def step_both(a, b, ps, qs, gen):
    """One step of optimizers `a` (on `ps`) and `b` (on `qs`) with the same random gradients."""
    for p, q in zip(ps, qs):
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        q.grad = p.grad.clone()
    a.step()
    b.step()


@pytest.mark.parametrize("states", [dict(exp_avg_dtype=torch.bfloat16), dict(exp_avg_dtype=torch.float16),
                                    dict(exp_avg_dtype=torch.uint8), dict(exp_avg_sq_dtype=torch.bfloat16),
                                    dict(exp_avg_sq_dtype=torch.float16), dict(exp_avg_sq_dtype=torch.uint8),
                                    dict(master_weight_dtype=torch.float16)])
@pytest.mark.parametrize("adam_w", [True, False])
def test_narrow_states_are_the_float64_step_rounded_once(states, adam_w):
    ps = params(torch.bfloat16)
    opt = FusedAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=adam_w, master_weights=True,
                    **states)
    dtypes = dict(zip(NAMES, (states.get("exp_avg_dtype", torch.float32),
                              states.get("exp_avg_sq_dtype", torch.float32),
                              states.get("master_weight_dtype", torch.float32))))
    gen = torch.Generator().manual_seed(1)
    for p in ps:
        opt.initialize_state(p)  # the master starts as the parameter, stored in its dtype
    for step in range(1, 5):
        before = {}
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            before[p] = tuple(opt.get_unscaled_state(p, n).double() for n in ("master_param", "exp_avg",
                                                                                "exp_avg_sq"))
        opt.step()
        for p in ps:
            w, m, v = adam64(*before[p][:1], p.grad.double(), *before[p][1:], step, adam_w)
            for name, want in zip(("master_param", "exp_avg", "exp_avg_sq"), (w, m, v)):
                got = opt.get_unscaled_state(p, name)
                assert got.dtype == torch.float32 and opt.state[p][name].dtype == (
                    torch.float32 if dtypes[name] == torch.uint8 else dtypes[name])
                err = (got.double() - want).abs()
                assert torch.all(err <= storage_error(dtypes[name], want)), (name, step, err.max().item())
            # the parameter is the float32 step rounded to bf16 (not the rounded fp16 master)
            assert torch.all((p.detach().double() - w).abs() <= 2.0 ** -8 * w.abs() + 1e-6 * w.abs().max())
    sd = opt.state_dict()
    assert all(t.dtype == torch.float32 for st in sd["state"].values() for t in st.values())
    other = FusedAdam(copy.deepcopy(ps), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=adam_w,
                      master_weights=True, **states)
    other.load_state_dict(sd)
    for p, q in zip(ps, other.param_groups[0]["params"]):
        for name in NAMES:
            assert torch.equal(opt.get_unscaled_state(p, name), other.get_unscaled_state(q, name)), name


def test_store_param_remainders_rebuilds_the_float32_masters_exactly():
    """bf16 parameters + int16 remainders give bit for bit the float32 masters of master_weights=True, and the
    parameter is the master rounded to nearest (ties away from zero)."""
    whole, split = params(torch.bfloat16), params(torch.bfloat16)
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True)
    a, b = FusedAdam(whole, **kw), FusedAdam(split, store_param_remainders=True, **kw)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        step_both(a, b, whole, split, gen)
        for p, q in zip(whole, split):
            master, rem = a.get_unscaled_state(p, "master_param"), b.get_unscaled_state(q, "master_param")
            assert rem.dtype == torch.int16 and b.state[q]["master_param"].dtype == torch.int16
            bits = master.view(torch.int32)
            assert torch.equal(rem, (bits & 0xFFFF).to(torch.int16))
            high = (bits >> 16) + ((bits & 0x8000) != 0).to(torch.int32)  # round half away from zero on the bits
            assert torch.equal(q.detach().view(torch.int16), high.to(torch.int16))
    sd = b.state_dict()
    c = FusedAdam(copy.deepcopy(split), store_param_remainders=True, **kw)
    c.load_state_dict(sd)
    assert torch.equal(c.state[c.param_groups[0]["params"][0]]["master_param"], b.state[split[0]]["master_param"])
    assert FusedAdam(params(torch.bfloat16), store_param_remainders=True, lr=LR).store_param_remainders is False


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop")
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_capturable_keeps_tensors_and_steps_as_the_default_mode(moments):
    ps, qs = params(torch.bfloat16), params(torch.bfloat16)
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True, exp_avg_dtype=moments,
              exp_avg_sq_dtype=moments)
    plain, capt = FusedAdam(ps, **kw), FusedAdam(qs + [], capturable=True, **kw)
    capt.add_param_group({"params": []})
    group = capt.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and isinstance(group["step"], torch.Tensor)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        step_both(plain, capt, ps, qs, gen)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
        for name in NAMES:
            assert torch.equal(plain.get_unscaled_state(p, name), capt.get_unscaled_state(q, name))
    assert [int(g["step"]) for g in capt.param_groups] == [3, 3]  # an empty group advances too
    # a GradScaler: the gradients are unscaled; an inf skips the step and the counter
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # what scaler.scale(loss) does first: the scale tensor exists
    for q in qs:
        q.grad = (torch.randn(q.shape, generator=gen) * 4.0).to(q.dtype)
    before = [q.detach().clone() for q in qs]
    scaler.step(capt)
    assert int(group["step"]) == 4 and not all(torch.equal(a, q) for a, q in zip(before, qs))
    qs[0].grad = torch.full(qs[0].shape, float("inf"), dtype=qs[0].dtype)
    before = [q.detach().clone() for q in qs]
    scaler.update()
    scaler.scale(torch.ones(()))
    scaler.step(capt)
    assert int(group["step"]) == 4 and all(torch.equal(a, q) for a, q in zip(before, qs))


def test_zero_fp8_moments_stay_zero():
    """An all-zero uint8 (E4M3) moment is cast with scale 1, not 1 / 0 (Transformer Engine's NaN)."""
    p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = FusedAdam([p], lr=LR, master_weights=True, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    p.grad = torch.zeros(8, dtype=torch.bfloat16)
    opt.step()
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.get_unscaled_state(p, name), torch.zeros(8))
    assert torch.equal(p.detach(), torch.ones(8, dtype=torch.bfloat16))


def test_master_weights_must_be_a_bool():
    ps = params(torch.bfloat16)
    with pytest.raises(TypeError, match="master_weights must be a bool"):
        FusedAdam(ps, master_weights=[p.float() for p in ps])
