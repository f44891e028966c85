"""Host cost guards: the aten operations one module call dispatches on the tensor path (the path a GPU runs), and
the operations of the batched update at autocast exit, which must not grow with the number of modules.

Nothing here is timed: a regression shows as more operations (counted with tests/dispatch_count.py). Ceilings are the
counts measured when they were set plus a small margin; the torch equivalent's count is printed next to them by
`python -m tests.dispatch_count` and reported in docs/performance.md.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.bench_overhead import _input, _te_module, _torch_module
from fp8kit.pytorch import host, registry
from fp8kit.pytorch.cast import current_scale_1d, scale_from_amax
from fp8kit.recipe import FLT_MAX, SCALE_MIN, DelayedScaling, Float8CurrentScaling
from tests.dispatch_count import DispatchCounter, count

RECIPES = {"current": Float8CurrentScaling, "delayed": DelayedScaling}

# (forward, backward) ceilings per module call, steady state, tensor path, CPU (the emulated GEMM included:
# per GEMM two FP8 -> float32 widenings that torch._scaled_mm does not need on a GPU; the scale_inv values are read
# from CPU memory without an operation). CPU tensors take CPU-faster sequences that cost operations: the amax as
# NaN-to-0, |.| and max (torch's CPU infinity norm is a slow loop), the widening as an int64 index and a gather
# from the 256 codes' values (torch's FP8 conversion is a per-element loop): plus 4 per Linear call, and less time
# (docs/performance.md). And each cast makes NaN products positive (`block_cast.positive_nan_`: one nan_to_num_),
# which a GPU's multiply does by itself: plus 3 per Linear call (x and W forward, dy backward). On accelerators
# (tests/test_cuda_path.py) none of these applies.
# The backward of a delayed-scaling module includes the step's backward update (one module ran), in which CPU tensors
# convert the used-column mask into a kept buffer (no temporary allocation; CUDA converts inside the kernel): plus 1.
CEILINGS = {
    ("Linear", "current"): (35, 32),
    ("Linear", "delayed"): (29, 44),
    ("LayerNormLinear", "current"): (36, 35),
    ("LayerNormLinear", "delayed"): (30, 47),
    ("LayerNormMLP", "current"): (72, 65),
    ("LayerNormMLP", "delayed"): (60, 74),
    ("TransformerLayer", "current"): (172, 159),
    ("TransformerLayer", "delayed"): (148, 162),
}
EXIT_CEILING = 16  # ops of one batched forward update (one key), whatever the number of modules (35 before the
# in-place update, 15 before the CPU counters' kept conversion buffer: docs/performance.md)


def _call_counts(kind: str, recipe, path: str = "tensor"):
    """(forward ops, exit ops, backward ops) of one steady-state call of one module, on the tensor or host path."""
    torch.manual_seed(0)
    module, x = _te_module(kind, 64, 4), _input(kind, 16, 64)
    with host.tensor_path() if path == "tensor" else host.host_path():
        for _ in range(3):  # first calls: registration, quantizers
            with te.autocast(recipe=recipe):
                y = module(x)
            y.sum().backward()
        held = {}
        ctx = te.autocast(recipe=recipe)
        ctx.__enter__()
        forward = count(lambda: held.__setitem__("y", module(x)))
        exit_ops = count(lambda: ctx.__exit__(None, None, None))
        backward = count(lambda: held["y"].sum().backward())
    return forward, exit_ops, backward


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_ops_per_module_call(kind, recipe_name):
    forward, exit_ops, backward = _call_counts(kind, RECIPES[recipe_name]())
    fwd_max, bwd_max = CEILINGS[(kind, recipe_name)]
    assert forward.total <= fwd_max, f"{kind} forward ({recipe_name}): {forward.total} ops\n{forward.table()}"
    assert backward.total <= bwd_max, f"{kind} backward ({recipe_name}): {backward.total} ops\n{backward.table()}"
    assert exit_ops.total <= EXIT_CEILING, exit_ops.table()


# The CPU's default path (the host path) with fp8kit's CPU kernels: a cast is one C call (two for current scaling's
# amax and cast) plus the allocation of its bytes (and values), the scale arithmetic is Python floats; left are the
# GEMMs with their widened operands' allocations, the transposed views, dy's contiguous copy and the bias gradient
# (the backward count includes, as above, the loss's sum and the gradients' accumulation). 19 + 21 before the cast
# allocated uint8 bytes and built its storage without views (docs/performance.md, "Fifth session").
HOST_CEILINGS = {"current": (11, 17), "delayed": (11, 17)}


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_host_path_ops_per_linear_call(recipe_name):
    from fp8kit.pytorch import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(f"fp8kit's CPU kernels are not available here: {cpu_kernels.reason()}")
    forward, exit_ops, backward = _call_counts("Linear", RECIPES[recipe_name](), path="host")
    fwd_max, bwd_max = HOST_CEILINGS[recipe_name]
    assert forward.total <= fwd_max, f"forward ({recipe_name}): {forward.total} ops\n{forward.table()}"
    assert backward.total <= bwd_max, f"backward ({recipe_name}): {backward.total} ops\n{backward.table()}"
    assert exit_ops.total == 0, exit_ops.table()  # the host update runs on NumPy views


def test_linear_stays_near_torch():
    """The goal the ceilings keep: a Linear call (current scaling, forward + backward) at most about four times
    torch.nn.Linear's operations on the CPU tensor path (emulated GEMMs included; the NaN-sign operations, which a
    GPU does not issue, left out)."""
    x = _input("Linear", 16, 64)
    ref = _torch_module("Linear", 64, 4, 16)

    def torch_step():
        ref(x).sum().backward()

    torch_step()
    baseline = count(torch_step).total
    forward, _, backward = _call_counts("Linear", Float8CurrentScaling())
    cpu_only = forward.ops["nan_to_num_"] + backward.ops["nan_to_num_"]
    assert forward.total + backward.total - cpu_only <= 4 * baseline


def _linears(n: int):
    torch.manual_seed(0)
    return [te.Linear(16, 16) for _ in range(n)]


def _update_ops(n: int, monkeypatch) -> tuple:
    """(ops at the autocast exit, ops of the backward update) of a steady-state step of `n` Linear modules."""
    layers, x = _linears(n), torch.randn(16, 16, requires_grad=True)
    # a recipe key no other test uses: a key whose flat buffer an earlier test's captured graph pinned takes no more
    # states (they update one by one), which would make this count depend on the order the tests run in
    recipe = DelayedScaling(amax_history_len=23)
    backward_counts = []
    original = registry.update_key

    def counted_update(*args, **kwargs):
        with DispatchCounter() as c:
            original(*args, **kwargs)
        backward_counts.append(c.total)

    with host.tensor_path():
        for step in range(4):
            ctx = te.autocast(recipe=recipe)
            ctx.__enter__()
            ys = [layer(x) for layer in layers]
            if step < 3:
                ctx.__exit__(None, None, None)
                torch.stack([y.sum() for y in ys]).sum().backward()
                continue
            block = layers[0].fp8_meta["scaling_fwd"]._block
            assert block is not None and all(m.fp8_meta["scaling_fwd"]._block is block for m in layers)
            exit_ops = count(lambda: ctx.__exit__(None, None, None))
            monkeypatch.setattr(registry, "update_key", counted_update)
            torch.stack([y.sum() for y in ys]).sum().backward()
            monkeypatch.setattr(registry, "update_key", original)
    return exit_ops, backward_counts


def test_exit_ops_do_not_grow_with_modules(monkeypatch):
    exit10, back10 = _update_ops(10, monkeypatch)
    exit200, back200 = _update_ops(200, monkeypatch)
    assert exit10.total == exit200.total <= EXIT_CEILING, (exit10.table(), exit200.table())
    assert len(back10) == len(back200) == 1 and back10 == back200, (back10, back200)
    assert not any(name in ("slice", "select", "cat", "stack") for name in exit200.ops if exit200.ops[name] > 8), \
        exit200.table()


def test_lean_current_scale_matches_the_rule():
    """`current_scale_1d` (fewer operations) gives the scale rule's bits for every kind of amax."""
    tiny = [0.0, 2.0 ** -149, 1e-38, 448.0 / FLT_MAX, 1e-36, 1.0]
    huge = [448.0 * 2.0 ** 63, 448.0 * 2.0 ** 64, 1e30, FLT_MAX, math.inf]
    for power_2 in (False, True):
        for eps in (0.0, 1e-12, 3.0):
            for fp8_max in (448.0, 57344.0):
                for a in tiny + huge + [0.37, 17.0, 448.0, 1e5]:
                    x = torch.tensor([a, -a / 2, math.nan], dtype=torch.float32)
                    got = current_scale_1d(x, fp8_max, eps, power_2)
                    amax = torch.tensor(a, dtype=torch.float32)
                    if eps > 0:
                        amax = torch.clamp_min(amax, eps)
                    want = scale_from_amax(amax, fp8_max, torch.ones_like(amax), power_2)
                    assert got.shape == (1,) and got.view(torch.int32).item() == want.view(torch.int32).item(), \
                        (a, eps, power_2, fp8_max, got.item(), want.item())
                    assert SCALE_MIN <= got.item() <= FLT_MAX


def _run_steps(layers, recipe, steps=3):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(16, 16, generator=g, requires_grad=True)
        with te.autocast(recipe=recipe):
            ys = [layer(x) for layer in layers]
        torch.stack([y.sum() for y in ys]).sum().backward()


def test_flat_buffer_drops_the_columns_of_deleted_modules():
    """Modules deleted from a key's flat buffer stop costing update work (their columns are compacted away), and
    the modules left update exactly as the same modules in a buffer of their own."""
    import copy
    import gc

    recipe = DelayedScaling(amax_history_len=8)
    torch.manual_seed(1)
    fresh = [te.Linear(16, 16) for _ in range(10)]
    twins = copy.deepcopy(fresh)
    with host.tensor_path():
        crowd = [te.Linear(16, 16) for _ in range(100)]
        _run_steps(crowd, recipe, 1)
        del crowd
        gc.collect()
        _run_steps(fresh, recipe)  # among 300 dead columns, compacted at the first update
        block = fresh[0].fp8_meta["scaling_fwd"]._block
        assert block is not None and block.columns == 30 and block.attached == 10
        want = [(m.fp8_meta[n].amax_history.clone(), m.fp8_meta[n].scale.clone()) for m in fresh
                for n in ("scaling_fwd", "scaling_bwd")]
        del fresh, block
        gc.collect()
        _run_steps(twins, recipe)
    got = [(m.fp8_meta[n].amax_history, m.fp8_meta[n].scale) for m in twins for n in ("scaling_fwd", "scaling_bwd")]
    for (h1, s1), (h2, s2) in zip(want, got):
        assert torch.equal(h1, h2) and torch.equal(s1, s2)
