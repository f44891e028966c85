"""Our port of Transformer Engine's tests/pytorch/test_fused_optimizer.py: FusedAdam and FusedSGD step by step
against torch.optim (a peer implementation), over dtypes and options, master weights, reduced-precision moments,
decoupled gradients, state_dict round trips and empty parameter groups (small tensors: seconds, not TE's 278k)."""

import pytest
import torch

import fp8kit.pytorch as te

ITERS = 5


def _pair(dtype, n=1031, shapes=None):
    """(reference float32 parameters, test parameters of `dtype`) with the same values: torch.optim in float32 is
    the reference for 16-bit parameters too (its own fp16 Adam overflows where eps underflows)."""
    torch.manual_seed(9876)
    tensors = [torch.rand(s, dtype=dtype) for s in (shapes or [(n,)])]
    ref = [torch.nn.Parameter(t.clone().float()) for t in tensors]
    tst = [torch.nn.Parameter(t.clone()) for t in tensors]
    return ref, tst


def _step_both(ref, tst, ref_optim, tst_optim):
    for r, t in zip(ref, tst):
        t.grad = torch.rand_like(t)
        r.grad = t.grad.float()
    ref_optim.step()
    tst_optim.step()


@pytest.mark.parametrize("dtype,adam_w_mode,weight_decay,tol", [
    (torch.float32, True, 0.0, {}),
    (torch.float32, False, 0.01, {}),
    (torch.float32, True, 0.1, {}),
    (torch.float16, True, 0.0, {"rtol": 1e-3, "atol": 1e-3}),
    (torch.bfloat16, True, 0.0, {"rtol": 1e-2, "atol": 1e-2}),
])
def test_fused_adam_matches_torch(dtype, adam_w_mode, weight_decay, tol):
    ref, tst = _pair(dtype, shapes=[(1031,), (7, 33)])
    opts = dict(lr=5e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_optim = ref_cls(ref, **opts)
    tst_optim = te.optimizers.FusedAdam(tst, adam_w_mode=adam_w_mode, **opts)
    for _ in range(ITERS):
        _step_both(ref, tst, ref_optim, tst_optim)
        torch.testing.assert_close([r.to(dtype) for r in ref], tst, **tol)


def test_fused_adam_frozen_and_empty_params():
    # a parameter without a gradient is left alone; an empty parameter at the end of a group is fine
    ref, tst = _pair(torch.float32, shapes=[(64,), (0,), (16,)])
    ref_optim = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0)
    tst_optim = te.optimizers.FusedAdam(tst, lr=1e-3)
    for _ in range(2):
        for r, t in zip(ref[:2], tst[:2]):
            r.grad = torch.rand_like(r)
            t.grad = r.grad.clone()
        ref_optim.step()
        tst_optim.step()
    torch.testing.assert_close(ref, tst)


@pytest.mark.parametrize("master_dtype,exp_avg_dtype,exp_avg_sq_dtype,grad_dtype,master_tol,model_tol", [
    (torch.float32, torch.float32, torch.float32, torch.float32, {}, None),
    (torch.float16, torch.float32, torch.float32, torch.float32, {"rtol": 2e-3, "atol": 2e-3}, None),
    (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, None, {"rtol": 2e-2, "atol": 2e-2}),
    (torch.float32, torch.float32, torch.float16, torch.float32, None, {"rtol": 2e-2, "atol": 2e-2}),
    (torch.float32, torch.uint8, torch.uint8, torch.float32, None, {"rtol": 1e-1, "atol": 1e-1}),
])
def test_precision_aware_fused_adam(master_dtype, exp_avg_dtype, exp_avg_sq_dtype, grad_dtype, master_tol,
                                    model_tol):
    # bf16 model weights with master weights, decoupled gradients and reduced-precision moments, against float32
    # torch.optim.Adam; then a state_dict round trip into a new optimizer carries on the same way
    torch.manual_seed(1)
    model = [torch.nn.Parameter(torch.randn(257, dtype=torch.bfloat16)),
             torch.nn.Parameter(torch.randn(8, 16, dtype=torch.bfloat16))]
    ref = [p.detach().clone().float().requires_grad_() for p in model]
    opts = dict(lr=1e-2, betas=(0.1, 0.25), eps=1e-8, weight_decay=0)

    def make():
        return te.optimizers.FusedAdam(model, master_weights=True, master_weight_dtype=master_dtype,
                                       exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype,
                                       use_decoupled_grad=True, **opts)

    ref_optim, tst_optim = torch.optim.Adam(ref, **opts), make()
    for i in range(2 * ITERS):
        if i == ITERS:
            state = tst_optim.state_dict()
            tst_optim = make()
            tst_optim.load_state_dict(state)
        for r, p in zip(ref, model):
            r.grad = torch.rand_like(r)
            p.decoupled_grad = r.grad.clone().to(grad_dtype)
        ref_optim.step()
        tst_optim.step()
        if master_tol is not None:
            masters = [tst_optim.get_unscaled_state(p, "master_param") for p in model]
            torch.testing.assert_close(masters, ref, **master_tol)
        torch.testing.assert_close([r.to(p.dtype) for r, p in zip(ref, model)], model,
                                   **(model_tol or {"rtol": 1.6e-2, "atol": 1e-5}))


@pytest.mark.parametrize("momentum,nesterov,weight_decay", [(0.0, False, 0.0), (0.9, False, 0.01),
                                                            (0.9, True, 0.0)])
def test_fused_sgd_matches_torch(momentum, nesterov, weight_decay):
    ref, tst = _pair(torch.float32, shapes=[(1031,), (5, 7)])
    opts = dict(lr=0.25, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    ref_optim, tst_optim = torch.optim.SGD(ref, **opts), te.optimizers.FusedSGD(tst, **opts)
    for _ in range(ITERS):
        _step_both(ref, tst, ref_optim, tst_optim)
        torch.testing.assert_close(ref, tst)


def test_fused_adam_native_training_matches_torch():
    # TE's test_native: a small model trained with each optimizer ends the same
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    b = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    b.load_state_dict(a.state_dict())
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.0)
    ob = te.optimizers.FusedAdam(b.parameters(), lr=1e-3)
    for _ in range(ITERS):
        x = torch.randn(8, 16)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    torch.testing.assert_close(list(a.parameters()), list(b.parameters()))
