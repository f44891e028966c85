"""make_graphed_callables on the CPU path with Transformer Engine's options (the per-tensor cases of TE's
test_cuda_graphs.py): several captures in one process, replays bit-identical to eager steps in float32, bf16 and
fp16, `sample_args` as lists, `capture_time_hooks`, the pipeline-parallel `_order` schedule and
`cache_quantized_params`. The eager twin of each graphed module is the reference."""

import pytest
import torch
import torch._dynamo

import fp8kit.pytorch as te
from fp8kit.pytorch.graph_schedule import schedule
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _twins(n, dtype=torch.float32, size=16, kind="Linear"):
    torch.manual_seed(3)
    made = [getattr(te, kind)(size, size, params_dtype=dtype) for _ in range(2 * n)]
    for e, g in zip(made[:n], made[n:]):
        g.load_state_dict(e.state_dict())
    return made[:n], made[n:]


def _step(module, x, recipe, **kwargs):
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x, **kwargs)
    (y.float() * 0.25).sum().backward()
    return y.detach(), x.grad


def _same_step(eager, graphed, x, recipe, **kwargs):
    y_e, dx_e = _step(eager, x, recipe, **kwargs)
    y_g, dx_g = _step(graphed, x, recipe, **kwargs)
    assert torch.equal(y_e, y_g) and torch.equal(dx_e, dx_g)
    for p, q in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(p.grad, q.grad)
        p.grad = q.grad = None


def test_several_captures_in_one_process_replay_eager_bits():
    """Each capture compiles its own function: three captures of differently typed modules fit under a recompile
    limit of 2 (a capture compiles twice: at capture and under the caller's autocast; captures shared one code
    object, and its limit, before); bf16 and fp16 replays are bit-identical, LayerNorm included (inductor computes
    an fp16 LayerNorm in float32 and rounds once, which moves the output by up to 3e-3)."""
    configs = [(torch.float32, DelayedScaling(amax_history_len=4), "LayerNormLinear"),
               (torch.bfloat16, DelayedScaling(), "Linear"), (torch.float16, Float8CurrentScaling(), "LayerNormLinear")]
    with torch._dynamo.config.patch(recompile_limit=2):
        for dtype, recipe, kind in configs:
            (eager,), (graphed,) = _twins(1, dtype, kind=kind)
            graphed = te.make_graphed_callables(graphed, [torch.randn(8, 16, dtype=dtype, requires_grad=True)],
                                                num_warmup_iters=1, enabled=True, recipe=recipe)
            for i in range(2):
                _same_step(eager, graphed, torch.randn(8, 16, dtype=dtype) * 4 ** i, recipe)


HOOK_ORDER = [(0, "forward_pre_hooks"), (0, "forward_hooks"), (1, "forward_pre_hooks"), (1, "forward_hooks"),
              (1, "backward_pre_hooks"), (1, "backward_hooks"), (0, "backward_pre_hooks"), (0, "backward_hooks")]


@pytest.mark.parametrize("with_order", [False, True])
def test_capture_time_hooks_run_at_warm_up_and_capture_only(with_order):
    recipe = Float8CurrentScaling()
    eager, modules = _twins(2)
    records = []

    def hook(index, name):
        def run(module):
            assert module is modules[index]
            records.append((index, name))
        return run

    hooks = [{name: {0: hook(i, name)} for name in ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks",
                                                     "backward_hooks")} for i in range(2)]
    samples = tuple([torch.ones(4, 16, requires_grad=True)] for _ in modules)  # lists are taken as tuples
    graphed = te.make_graphed_callables(tuple(modules), samples, num_warmup_iters=2, enabled=True, recipe=recipe,
                                        _order=[1, 2, -2, -1] if with_order else None, capture_time_hooks=hooks)
    assert records == HOOK_ORDER * 3  # two warm-up passes and the capture
    for e, g, m in zip(eager, graphed, modules):
        y_e, dx_e = _step(e, torch.ones(4, 16), recipe)
        y_g, dx_g = _step(g, torch.ones(4, 16), recipe)  # a module, or with _order its graphed forward
        assert torch.equal(y_e, y_g) and torch.equal(dx_e, dx_g)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(e.parameters(), m.parameters()))
    assert records == HOOK_ORDER * 3  # replays run no hook
    bad = [{"forward_hook": {}}, None]
    with pytest.raises(ValueError, match="unknown capture_time_hooks keys"):
        te.make_graphed_callables(tuple(modules), samples, capture_time_hooks=bad)


def test_order_schedule_follows_the_pipeline():
    """Two chunks of one layer, two microbatches: sample_args are chunk 1's microbatches, then chunk 2's."""
    steps = schedule(2, 4, [1, 2, 1, 2, -2, -1, -2, -1], None)
    assert steps == [("fwd", 0, 0), ("fwd", 1, 2), ("fwd", 0, 1), ("fwd", 1, 3),
                     ("bwd", 1, 2), ("bwd", 0, 0), ("bwd", 1, 3), ("bwd", 0, 1)]
    # one chunk of two layers: a chunk's backward runs its layers in reverse
    assert schedule(2, 2, [1, -1], None) == [("fwd", 0, 0), ("fwd", 1, 1), ("bwd", 1, 1), ("bwd", 0, 0)]
    assert schedule(2, 2, None, None) == [("fwd", 0, 0), ("fwd", 1, 1), ("bwd", 1, 1), ("bwd", 0, 0)]
    with pytest.raises(ValueError, match="expected 4 sample_args"):
        schedule(2, 2, [1, 2, 1, 2, -2, -1, -2, -1], [1, 1])
    with pytest.raises(ValueError, match="same number of times"):
        schedule(2, 4, [1, 2, 1, -2, -1, -1], None)
    with pytest.raises(ValueError, match="before its forward"):
        schedule(1, 1, [-1, 1], None)
    with pytest.raises(NotImplementedError, match="fractional"):
        schedule(1, 1, [1, -1, -1.5], None)


def test_graphs_under_an_order_replay_eager_bits():
    recipe = DelayedScaling(amax_history_len=4)
    eager, modules = _twins(2)
    samples = tuple((torch.randn(8, 16, requires_grad=True),) for _ in range(4))  # 2 layers x 2 microbatches
    forwards = te.make_graphed_callables(tuple(modules), samples, num_warmup_iters=1, enabled=True, recipe=recipe,
                                         _order=[1, 2, 1, 2, -2, -1, -2, -1])
    # as in Transformer Engine: one graphed forward per (layer, microbatch) sample, chunk by chunk
    assert len(forwards) == 4 and all(not isinstance(f, torch.nn.Module) for f in forwards)
    for i in range(2):
        x = torch.randn(8, 16) * 3 ** i
        for s, forward in enumerate(forwards):
            e = eager[s // 2]
            y_e, dx_e = _step(e, x, recipe)
            y_g, dx_g = _step(forward, x, recipe)
            assert torch.equal(y_e, y_g) and torch.equal(dx_e, dx_g)
            for p, q in zip(e.parameters(), modules[s // 2].parameters()):
                assert torch.equal(p.grad, q.grad)
                p.grad = q.grad = None
        for e, g in zip(eager, modules):
            for a, b in ((e.fp8_meta["scaling_fwd"], g.fp8_meta["scaling_fwd"]),
                         (e.fp8_meta["scaling_bwd"], g.fp8_meta["scaling_bwd"])):
                assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)


def test_cache_quantized_params():
    """Current scaling: the graphed module takes is_first_microbatch (required, as in Transformer Engine) and
    gives the eager module's numbers for it; delayed scaling is refused with the reason."""
    recipe = Float8CurrentScaling()
    (eager,), (graphed,) = _twins(1)
    graphed = te.make_graphed_callables(graphed, (torch.randn(8, 16, requires_grad=True),), num_warmup_iters=1,
                                        enabled=True, recipe=recipe, cache_quantized_params=True)
    for microbatch in range(2):
        _same_step(eager, graphed, torch.randn(8, 16), recipe, is_first_microbatch=microbatch == 0)
    with pytest.raises(ValueError, match="is_first_microbatch"):
        with te.autocast(recipe=recipe):
            graphed(torch.randn(8, 16))
    with pytest.raises(NotImplementedError, match="DelayedScaling"):
        te.make_graphed_callables(te.Linear(16, 16), (torch.randn(8, 16),), enabled=True,
                                  recipe=DelayedScaling(), cache_quantized_params=True)
