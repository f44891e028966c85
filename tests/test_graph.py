"""te.make_graphed_callables (issue 15): Transformer Engine's signature, the state left untouched by warm-up and
capture, replayed steps bit-identical to eager ones (outputs, input and parameter gradients, amax histories,
scales, counters) under both recipes on the CPU path (torch.compile graphs), and the errors. The CUDA-graph path
runs in the `cuda`-marked test (skipped without a GPU)."""

import inspect

import pytest
import torch
import torch._dynamo
from accelerator_audit import SYNC_OPS
from torch.utils._python_dispatch import TorchDispatchMode

import fp8kit.pytorch as te
import fp8kit.pytorch.graph as graph
from fp8kit.pytorch import gemm as gemm_module
from fp8kit.pytorch import host
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

# Transformer Engine's parameters, in order (transformer_engine/pytorch/graph.py, TE main 2.20.0.dev0)
TE_PARAMETERS = [
    "modules", "sample_args", "num_warmup_iters", "allow_unused_input", "sample_kwargs", "fp8_enabled",
    "fp8_calibrating", "fp8_recipe", "fp8_group", "fp8_weight_caching", "enabled", "calibrating", "recipe",
    "amax_reduction_group", "cache_quantized_params", "_order", "_num_layers_per_chunk", "pool",
    "retain_graph_in_backward", "_reuse_graph_input_output_buffers", "clone_param_grads_on_return",
    "pre_warmup_hook", "post_warmup_hook", "capture_time_hooks",
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """The CPU graphs use aot_eager (bit-identical to eager; inductor's kernels round reductions differently,
    tests/test_compile.py covers that); each test starts from an empty dynamo cache."""
    assert graph.CPU_BACKEND == "aot_eager"
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recipe(name):
    if name == "delayed":
        return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    return Float8CurrentScaling(fp8_format=Format.HYBRID)


def _model(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(te.Linear(32, 64, params_dtype=dtype, device=device), torch.nn.ReLU(),
                               te.LayerNormLinear(64, 16, params_dtype=dtype, device=device))


def _states(model):
    out = []
    for m in model.modules():
        if hasattr(m, "fp8_meta"):
            for name in ("scaling_fwd", "scaling_bwd"):
                s = m.fp8_meta[name]
                if s is not None:
                    out += [s.amax_history.clone(), s.scale.clone(), s.count.clone()]
    return out


def _step(model, x, recipe):
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = model(x)
    (y.float() * 0.5).sum().backward()
    return y.detach(), x.grad


def test_signature_is_transformer_engines():
    assert list(inspect.signature(te.make_graphed_callables).parameters) == TE_PARAMETERS


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_replayed_steps_equal_eager_steps(recipe_name):
    recipe = _recipe(recipe_name)
    eager, graphed = _model(), _model()
    # one eager step first: the graphed model starts from a trained state, which warm-up must not disturb
    x0 = torch.randn(8, 32)
    for m in (eager, graphed):
        _step(m, x0, recipe)
        m.zero_grad()
    before = _states(graphed)
    graphed = te.make_graphed_callables(graphed, (torch.randn(8, 32, requires_grad=True),), enabled=True,
                                        recipe=recipe)
    after = _states(graphed)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "warm-up or capture changed the FP8 state"
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.05)
    torch.manual_seed(1)
    for i in range(4):
        x = torch.randn(8, 32) * 10.0 ** (i % 3 - 1)  # magnitudes change: the scales move
        y_e, dx_e = _step(eager, x, recipe)
        y_g, dx_g = _step(graphed, x, recipe)
        assert torch.equal(y_e, y_g), f"step {i}: outputs"
        assert torch.equal(dx_e, dx_g), f"step {i}: input gradients"
        for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {i}: {name} gradients"
        opt_e.step()
        opt_g.step()
        opt_e.zero_grad()
        opt_g.zero_grad()
        s_e, s_g = _states(eager), _states(graphed)
        assert len(s_e) == len(s_g) and all(torch.equal(a, b) for a, b in zip(s_e, s_g)), f"step {i}: states"
    if recipe_name == "delayed":
        assert int(_states(graphed)[2]) == 5, "the forward update counter counts the replayed steps"
    # switched to eval, a module graphed in training mode runs its own forward (dropout and friends differ)
    eager.eval()
    graphed.eval()
    with torch.no_grad(), te.autocast(recipe=recipe):
        assert torch.equal(eager(x), graphed(x))


def test_several_modules_and_the_deprecated_names():
    recipe = _recipe("delayed")
    eager, graphed = (_model(), _model()), (_model(), _model())
    samples = ((torch.randn(8, 32, requires_grad=True),), (torch.randn(8, 32, requires_grad=True),))
    with pytest.warns(DeprecationWarning, match="fp8_recipe"):
        graphed = te.make_graphed_callables(graphed, samples, fp8_enabled=True, fp8_recipe=recipe)
    assert isinstance(graphed, tuple) and len(graphed) == 2
    torch.manual_seed(2)
    for i in range(2):
        x = torch.randn(8, 32) * 10.0 ** i
        for e, g in zip(eager, graphed):
            assert torch.equal(_step(e, x, recipe)[0], _step(g, x, recipe)[0])
        assert all(torch.equal(a, b) for e, g in zip(eager, graphed) for a, b in zip(_states(e), _states(g)))
    with pytest.raises(RuntimeError, match="autocast"):  # its delayed-scaling updates need the step's autocast
        graphed[0](torch.randn(8, 32, requires_grad=True))
    with pytest.raises(ValueError, match="both are set"):
        te.make_graphed_callables(_model(), (torch.randn(8, 32),), fp8_recipe=recipe, recipe=recipe)


def test_errors_name_the_problem():
    x = (torch.randn(8, 32, requires_grad=True),)
    for option in ("cache_quantized_params", "_reuse_graph_input_output_buffers"):
        with pytest.raises(NotImplementedError, match=option):
            te.make_graphed_callables(_model(), x, enabled=True, **{option: True})
    with pytest.raises(TypeError, match="torch.nn.Module"):
        te.make_graphed_callables(lambda t: t, x)
    with pytest.raises(TypeError, match="tuple \\(or list\\) of tensors"):
        te.make_graphed_callables(_model(), ([1.0],))
    with pytest.raises(ValueError, match="num_warmup_iters"):
        te.make_graphed_callables(_model(), x, num_warmup_iters=0)
    with pytest.raises(ValueError, match="2 modules but 1 sample_args"):
        te.make_graphed_callables((_model(), _model()), (x,))


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_cuda_graphs_replay_eager_numbers(recipe_name):
    """On CUDA the callables are CUDA graphs (torch.cuda.make_graphed_callables): same numbers as eager."""
    recipe = _recipe(recipe_name)
    eager, graphed = _model("cuda", torch.bfloat16), _model("cuda", torch.bfloat16)
    graphed = te.make_graphed_callables(
        graphed, (torch.randn(16, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True),), enabled=True,
        recipe=recipe)
    torch.manual_seed(1)
    for i in range(4):
        x = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16) * 10.0 ** (i % 3 - 1)
        y_e, dx_e = _step(eager, x, recipe)
        y_g, dx_g = _step(graphed, x, recipe)
        assert torch.equal(y_e, y_g) and torch.equal(dx_e, dx_g), f"step {i}"
        for p, q in zip(eager.parameters(), graphed.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {i}: gradients"
        eager.zero_grad()
        graphed.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(_states(eager), _states(graphed))), f"step {i}: states"


def _gemm_without_host_reads(a, b, out_dtype, bias):
    out = (a.values(torch.float32) @ b.values(torch.float32)) * (a.scale_inv * b.scale_inv)
    return (out + bias.float() if bias is not None else out).to(out_dtype)


class _Recorder(TorchDispatchMode):
    """Fails on operations that would make the host wait for a device, and keeps, for each watched tensor (by
    storage), its value after the last operation that wrote it (in-place and out= arguments, by the op's schema)."""

    def __init__(self, watched):
        super().__init__()
        self.watched = {}  # storage -> the watched tensors viewing it (states may share a flat buffer)
        for t in watched:
            self.watched.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        self.after_last_write = {}  # id(watched tensor) -> its value after the last write to its storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            raise AssertionError(f"host synchronisation: {func}")
        out = func(*args, **kwargs)
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name, args[i] if i < len(args) else None)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
                    for w in self.watched.get(ptr, ()):
                        self.after_last_write[id(w)] = w.clone()
        return out


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_a_step_changes_the_state_only_through_tensor_operations(recipe_name, monkeypatch):
    """What a replayed graph relies on: on the tensor path (the path of accelerators and of compiled code) a whole
    step (forward, backward, the updates at autocast exit and after the backward) issues no host synchronisation,
    keeps every state tensor object it started with, and every state tensor it changes is written by a recorded
    tensor operation, so nothing of the update happens in Python where a replay would skip it."""
    # the CPU GEMM reads its alpha on the host (CPU tensors only; accelerators run torch._scaled_mm, audited on meta
    # tensors in tests/test_cuda_path.py): here a GEMM that keeps the scales in tensors
    monkeypatch.setattr(gemm_module, "emulated", _gemm_without_host_reads)
    recipe = _recipe(recipe_name)
    model = _model()
    with host.tensor_path():
        _step(model, torch.randn(8, 32), recipe)  # first-call setup (state creation, registration) unrecorded
        states = [m.fp8_meta[n] for m in model.modules() if hasattr(m, "fp8_meta")
                  for n in ("scaling_fwd", "scaling_bwd") if m.fp8_meta[n] is not None]
        tensors = [(s._buffer, s._scale, s._count) for s in states]
        before = [[t.clone() for t in ts] for ts in tensors]
        recorder = _Recorder([t for ts in tensors for t in ts])
        with recorder:
            _step(model, torch.randn(8, 32) * 100.0, recipe)  # another magnitude: the scales move
    assert all(a is b for ts, s in zip(tensors, states) for a, b in zip(ts, (s._buffer, s._scale, s._count))), \
        "the step replaced state tensors (a replayed graph would keep writing the old ones)"
    changed = [t for ts, olds in zip(tensors, before) for t, old in zip(ts, olds) if not torch.equal(t, old)]
    if recipe_name == "delayed":
        assert changed, "the step updated no delayed-scaling state"
    else:
        assert not changed
    for t in changed:  # its final value is what the last tensor operation writing it left
        last = recorder.after_last_write.get(id(t))
        assert last is not None and torch.equal(t, last), f"a state tensor {tuple(t.shape)} changed outside any " \
                                                          "tensor operation"
