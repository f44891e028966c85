"""The accelerator path, checked on a CPU with `meta` tensors (issue 16, requirement 1).

fp8kit takes its accelerator path for every device but the CPU, so a Linear on `meta` tensors runs the code a GPU
runs: the quantizers' device branches, `torch._scaled_mm` with its shape, dtype and layout checks, the Triton
kernels' host functions (their launches are recorded and skipped), and the batched updates. tests/
accelerator_audit.py fails on any host synchronisation, checks `_scaled_mm` as CUDA does, and counts the full-size
memory passes per role.

Expected passes per training step (forward + backward) are written out below; a change in the Linear's wiring shows
up here as a changed count, to be explained in this file and in docs/kernels.md.
"""

import gc
import warnings

import pytest
import torch
from accelerator_audit import AcceleratorAudit

import fp8kit.pytorch as te
from fp8kit.bench_ops import linear_op_counts, meta_autocast_off
from fp8kit.pytorch import kernels
from fp8kit.pytorch.gemm import gemm
from fp8kit.pytorch.quantizer import CurrentQuantizer, DelayedQuantizer
from fp8kit.pytorch.state import ScalingState
from fp8kit.pytorch.tensor import Float8TensorStorage
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

M, K, N = 384, 256, 160  # x [M, K], W [N, K], dy [M, N]: three different element counts
ROLES = {"x": M * K, "weight": N * K, "grad_output": M * N}
META = torch.device("meta")

# Full-size passes per Linear step, by (recipe, kernels on). Linear casts x and W with their transposes and dy with
# the bias gradient (`quantize(x, transpose=True)`, `quantize(W, transpose=True)`, `quantize_dbias(dy)`;
# docs/kernels.md, "How Linear calls them"): with the kernels and delayed scaling one pass per operand, each reading
# the operand once (2 bytes per element, bf16) and writing the FP8 bytes and their transpose (1 + 1); current scaling
# adds its amax pass. Without kernels: amax 2 (NaN -> 0, then the inf-norm) + cast 3 (multiply into float32, clamp,
# convert) + the transpose copy, and the bias-gradient sum for dy.
FUSED = {
    ("delayed", True): {"x": 1, "weight": 1, "grad_output": 1},
    ("current", True): {"x": 2, "weight": 2, "grad_output": 2},
    ("delayed", False): {"x": 6, "weight": 6, "grad_output": 7},
    ("current", False): {"x": 6, "weight": 6, "grad_output": 7},
}
FUSED_BYTES_PER_ELEMENT = {("delayed", True): 4.0, ("current", True): 6.0}  # current: + the amax pass (2 bytes)


def _recipe(name, fmt=Format.HYBRID):
    return DelayedScaling(amax_history_len=4, fp8_format=fmt) if name == "delayed" else \
        Float8CurrentScaling(fp8_format=fmt)


@pytest.fixture
def on_meta():
    """torch has no autocast state for `meta`: `torch.is_autocast_enabled("meta")` raises, so it answers False."""
    with meta_autocast_off():
        yield
    kernels.set_enabled(None)
    gc.collect()  # meta modules' states leave the autocast registry before the next test's updates


def _audited(step, roles=ROLES, warmup=1, steps=2):
    """Run `step()` `warmup` times unaudited (first-call caches), then `steps` times audited; the last audit."""
    for _ in range(warmup):
        step()
    for _ in range(steps):
        audit = AcceleratorAudit(roles)
        with kernels.observe_launches() as launches, audit:
            step()
        audit.add_launches(launches)
        assert audit.transfers == [], audit.transfers
        assert audit.mixed == [], audit.mixed
    return audit


def _linear_audit(recipe, m=M, k=K, n=N, roles=ROLES, steps=2):
    """Audit Linear(k, n) forward + backward on a meta [m, k] input. The module lives only in here, so that a
    failing test's traceback does not keep its states registered."""
    layer = te.Linear(k, n, device=META, params_dtype=torch.bfloat16)
    x = torch.empty(m, k, device=META, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.empty(m, n, device=META, dtype=torch.bfloat16)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        with te.autocast(recipe=recipe):
            y = layer(x)
        y.backward(dy)
        assert y.shape == dy.shape and x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape

    return _audited(step, roles=roles, steps=steps)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("use_kernels", [True, False])
def test_linear_step_on_meta(on_meta, recipe_name, use_kernels):
    """Linear forward + backward on the accelerator path: no host sync, no CPU tensor, three `_scaled_mm` calls that
    pass CUDA's checks (HYBRID: dgrad and wgrad are E5M2 x E4M3), and the documented passes per operand."""
    kernels.set_enabled(use_kernels)
    audit = _linear_audit(_recipe(recipe_name))
    assert len(audit.gemms) == 3
    assert dict(audit.passes) == FUSED[(recipe_name, use_kernels)], dict(audit.ops)


def _quantizers(recipe_name, fwd, bwd):
    if recipe_name == "delayed":
        return DelayedQuantizer(fwd, 0, torch.float8_e4m3fn), DelayedQuantizer(fwd, 1, torch.float8_e4m3fn), \
            DelayedQuantizer(bwd, 0, torch.float8_e5m2)
    return CurrentQuantizer(torch.float8_e4m3fn), CurrentQuantizer(torch.float8_e4m3fn), \
        CurrentQuantizer(torch.float8_e5m2)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("use_kernels", [True, False])
def test_fused_step_makes_one_pass_per_operand(on_meta, recipe_name, use_kernels):
    """The three GEMMs of a Linear step called as docs/kernels.md tells Linear to: each operand quantized once with
    its transpose, the bias gradient fused into dy's cast, `gemm` taking the column-major operands from `_transpose`
    (no copies)."""
    kernels.set_enabled(use_kernels)
    fwd, bwd = ScalingState(3, 4, META), ScalingState(2, 4, META)
    q_x, q_w, q_dy = _quantizers(recipe_name, fwd, bwd)
    x = torch.empty(M, K, device=META, dtype=torch.bfloat16)
    w = torch.empty(N, K, device=META, dtype=torch.bfloat16)
    b = torch.empty(N, device=META, dtype=torch.bfloat16)
    dy = torch.empty(M, N, device=META, dtype=torch.bfloat16)

    def step():  # docs/kernels.md, "How Linear calls them"
        x8, w8 = q_x.quantize(x, transpose=True), q_w.quantize(w, transpose=True)
        y = gemm(x8, w8.transposed(), x.dtype, b, use_fast_accum=True)  # fprop  y  = x @ W.T + b
        x_saved, w_saved = x8.transpose_view().t(), w8.transpose_view().t()  # saved: transpose views
        dy8, db = q_dy.quantize_dbias(dy)
        dx = gemm(dy8, Float8TensorStorage(data=w_saved, fp8_scale_inv=w8.scale_inv), x.dtype)  # dgrad  dx = dy @ W
        # wgrad  dW = dy.T @ x
        dw = gemm(dy8.transposed(), Float8TensorStorage(data=x_saved, fp8_scale_inv=x8.scale_inv), w.dtype)
        assert (y.shape, dx.shape, dw.shape, db.shape) == ((M, N), (M, K), (N, K), (N,))
        assert y.is_contiguous() and dx.is_contiguous() and dw.is_contiguous() and db.dtype == torch.bfloat16

    audit = _audited(step)
    assert len(audit.gemms) == 3
    assert dict(audit.passes) == FUSED[(recipe_name, use_kernels)], dict(audit.ops)
    if use_kernels:
        for role in ROLES:
            assert audit.bytes[role] == FUSED_BYTES_PER_ELEMENT[(recipe_name, use_kernels)], dict(audit.bytes)


@pytest.mark.parametrize("use_kernels", [True, False])
def test_unaligned_shapes_run_padded(on_meta, use_kernels):
    """K = 100, N = 50257 (a vocabulary) and M = 30: no error; the GEMMs zero-pad K and N to multiples of 16 (one
    warning per shape), pass `_scaled_mm`'s checks, and give contiguous results of the right shapes."""
    kernels.set_enabled(use_kernels)
    m, k, n = (30, 100, 50257) if use_kernels else (31, 99, 50259)  # new shapes per case: one warning per shape
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        audit = _linear_audit(_recipe("delayed"), m, k, n, roles={"x": m * k, "weight": n * k}, steps=1)
    padding = [str(w.message) for w in caught if "zero-padded" in str(w.message)]
    assert len(padding) == 3, padding  # fprop, dgrad and wgrad, once each
    assert any(f"N={n} -> {-(-n // 16) * 16}" in p for p in padding), padding
    assert [g[0][1] % 16 for g in audit.gemms] == [0, 0, 0] and all(g[1][1] % 16 == 0 for g in audit.gemms)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_pure_e5m2_runs_on_the_device(on_meta, recipe_name):
    """Format.E5M2 makes E5M2 x E5M2 GEMMs, which cuBLASLt cannot run: they are widened on the device (no
    `_scaled_mm`, no host sync, no CPU tensor)."""
    kernels.set_enabled(True)
    audit = _linear_audit(_recipe(recipe_name, Format.E5M2))
    assert audit.gemms == []
    assert sum("aten.mm" in op for ops in audit.ops.values() for op in ops) >= 3


def test_scaled_mm_refuses_what_cuda_refuses():
    """The audit itself: an E5M2 x E5M2 `_scaled_mm`, a CPU scale and a host read are caught."""
    from accelerator_audit import HostSync

    a = torch.empty(32, 32, device=META, dtype=torch.float8_e5m2)
    b = torch.empty(32, 32, device=META, dtype=torch.float8_e5m2).t()
    one = torch.ones((), device=META)
    with pytest.raises(AssertionError, match="Float8_e5m2"), AcceleratorAudit({}):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="scales"), AcceleratorAudit({}):
        torch._scaled_mm(a.to(torch.float8_e4m3fn), b, scale_a=torch.ones(()), scale_b=one,
                         out_dtype=torch.bfloat16)
    with pytest.raises(HostSync), AcceleratorAudit({}):
        float(one)
    with pytest.raises(HostSync), AcceleratorAudit({}):
        one.cpu()


# Operations one Linear(64, 64) forward + backward dispatches on the accelerator path (aten operations plus kernel
# launches; 16 tokens, bf16, steady state; the backward of delayed scaling includes its update), with the Triton
# kernels on and off; torch.nn.Linear dispatches 13 here. Ceilings: the counts when they were set (docs/
# performance.md, "Host overhead"). Delayed: 70 and 134 before the in-place update. Then 61 / 57 (kernels on) and
# 71 / 91 (off); 3 fewer (current, kernels on: one per cast) since the casts write no scale the quantizers do not keep,
# 6 fewer since the cast kernels read the amax kernel's int32 output as is (no float32 view: a view and a detach per
# cast), 5 fewer (kernels on; 3 off) since dgrad takes the forward's FP8 weight back from its saved transpose
# instead of rebuilding it, and 3 fewer since `torch._scaled_mm` takes the column-major operand a storage keeps.
ACCELERATOR_OPS = {("current", True): 44, ("delayed", True): 49, ("current", False): 65, ("delayed", False): 85}


def test_linear_host_operations_on_the_accelerator_path():
    rows = {r["variant"]: r for r in linear_op_counts() if r["path"] == "accelerator"}
    for (recipe_name, use_kernels), ceiling in ACCELERATOR_OPS.items():
        row = rows[f"fp8kit {recipe_name}, kernels {'on' if use_kernels else 'off'}"]
        assert row["ops"] + row["launches"] <= ceiling, (recipe_name, use_kernels, row)
        if use_kernels:  # the fused casts: a cast launch per operand (+ the amax pass under current scaling)
            assert row["launches"] <= 7, row


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
def test_accelerator_gemm_operands_give_the_emulated_results(recipe, monkeypatch):
    """The GEMM path a GPU runs, with torch's CPU `_scaled_mm` (tests/accelerator_sim.py): `torch._scaled_mm` takes
    the column-major operand the storages keep (the transpose of the kept transpose view; the column-major bytes of
    an operand rebuilt from the saved transpose) without making one, and a Linear's outputs and gradients at
    non-square shapes agree with the CPU emulation's (the same FP8 operands; bf16 rounding apart), so no operand
    is read in the wrong layout."""
    from accelerator_sim import accelerator_gemm_path

    from fp8kit.pytorch import host

    used = []
    original = Float8TensorStorage.column_major_view

    def column_major_view(self):
        view = original(self)
        if view is not None:
            used.append(self._transpose is not None)
        return view

    def run():
        torch.manual_seed(0)
        layer = te.Linear(96, 48, params_dtype=torch.bfloat16)
        results = []
        for step in range(3):
            x = (torch.randn(32, 96, dtype=torch.bfloat16) * 2.0 ** step).requires_grad_()
            with te.autocast(recipe=recipe):
                y = layer(x)
            y.backward(torch.randn(32, 48, dtype=torch.bfloat16))
            results += [y.float(), x.grad.float(), layer.weight.grad.float()]
            layer.zero_grad()
        return results

    with host.tensor_path():
        want = run()
        monkeypatch.setattr(Float8TensorStorage, "column_major_view", column_major_view)
        with accelerator_gemm_path():
            got = run()
    assert True in used and False in used  # both kinds of kept column-major operand
    for a, b in zip(want, got):
        assert (a - b).abs().max() <= 1e-2 * a.abs().max(), (a - b).abs().max()
