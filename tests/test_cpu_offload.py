"""te.get_cpu_offload_context: gradients equal to a run without offload, and the tensors a layer saves are copied to
host buffers, dropped, and given back (other storage, same values) to the backward, on the schedule Transformer
Engine documents; manual synchronization; the options' errors."""

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import cpu_offload
from fp8kit.recipe import DelayedScaling

WIDTH = 16
# nn.Linear saves a transposed (non-contiguous) view: it stays, with the warning checked in test_what_stays_...
# and two-layer models offload their first layer, which TE (and fp8kit) warn against
pytestmark = [pytest.mark.filterwarnings("ignore:Tried to offload a non-contiguous tensor"),
              pytest.mark.filterwarnings("ignore:Offloading num_layers == model_layers - 1")]


class _Probe(torch.autograd.Function):
    """y = x * w; records, per call, the storage of the x it saved and the one its backward got back."""

    log = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.entry = {"saved": x.data_ptr(), "value": x.detach().clone()}
        _Probe.log.append(ctx.entry)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        ctx.entry.update(restored=x.data_ptr(), same_values=torch.equal(x, ctx.entry["value"]))
        return grad * w, (grad * x).sum(0)


class Layer(torch.nn.Module):
    def __init__(self, fp8: bool):
        super().__init__()
        self.linear = te.Linear(WIDTH, WIDTH) if fp8 else torch.nn.Linear(WIDTH, WIDTH)
        self.scale = torch.nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x):
        return _Probe.apply(torch.nn.functional.gelu(self.linear(x)), self.scale)


def _model(layers, fp8=False):
    torch.manual_seed(0)
    return torch.nn.ModuleList(Layer(fp8) for _ in range(layers))


def _run(model, x, context=None, sync=None, fp8=False, controller=None):
    _Probe.log.clear()
    x = x.clone().requires_grad_(True)
    with te.autocast(enabled=fp8, recipe=DelayedScaling()):
        h = x
        for i, layer in enumerate(model):
            if context is None:
                h = layer(h)
                continue
            with context:
                h = layer(h)
            h = sync(h)
            if controller is not None:
                controller.start_offload_layer(i)
        if controller is not None:
            for i in range(len(model)):
                controller.release_activation_forward_gpu_memory(i)
            for i in reversed(range(len(model))):
                controller.start_reload_layer(i)
    h.square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads, list(_Probe.log)


@pytest.fixture
def small_threshold(monkeypatch):
    """Offload tensors of any size (the small models here save non-contiguous views too: those stay, with a
    warning)."""
    monkeypatch.setattr(cpu_offload, "MIN_OFFLOAD_NUMEL", 1)


@pytest.mark.parametrize("fp8", [False, True])
def test_default_schedule_same_gradients_and_offloaded_layers_moved(small_threshold, fp8):
    plain, offloaded, x = _model(4, fp8), _model(4, fp8), torch.randn(8, WIDTH)  # same weights, own FP8 states
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4)
    for _ in range(2):  # a second iteration starts over (and, with FP8, uses the updated scales)
        reference, _ = _run(plain, x, fp8=fp8)
        grads, log = _run(offloaded, x, context, sync, fp8=fp8)
        for got, want in zip(grads, reference):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert all(entry["same_values"] for entry in log)
        moved = [entry["restored"] != entry["saved"] for entry in log]
        assert moved == [True, True, False, False]  # layers 0 and 1 offloaded, the others kept


def test_offloaded_tensors_leave_the_layer_before_backward(small_threshold):
    model, x = _model(3), torch.randn(4, WIDTH)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3)
    h = x.requires_grad_(True)
    for layer in model:
        with context:
            h = layer(h)
        h = sync(h)
    state = context.synchronizer.layer_states[0]
    assert state.state == "offload_finished" and state.saved == [] and len(state.host) > 0
    assert context.synchronizer.get_offloaded_total_size_mb() > 0
    assert context.synchronizer.layer_states[1].host == []  # not offloaded
    h.sum().backward()
    assert context.synchronizer.get_offloaded_total_size_mb() == 0  # released after its backward


def test_manual_synchronization(small_threshold):
    model, x = _model(3), torch.randn(4, WIDTH)
    reference, _ = _run(model, x)
    context, sync, controller = te.get_cpu_offload_context(enabled=True, model_layers=3, manual_synchronization=True)
    assert isinstance(controller, te.ManualOffloadSynchronizer)
    grads, log = _run(model, x, context, sync, controller=controller)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(entry["restored"] != entry["saved"] and entry["same_values"] for entry in log)
    grads, log = _run(model, x, context, sync)  # no controller calls: nothing moves
    assert all(entry["restored"] == entry["saved"] for entry in log)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_what_stays_small_marked_and_parameters():
    model, x = _model(2), torch.randn(4, WIDTH)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    _, log = _run(model, x, context, sync)  # default threshold: these tensors are far below it
    assert all(entry["restored"] == entry["saved"] for entry in log)

    big = torch.randn(cpu_offload.MIN_OFFLOAD_NUMEL, requires_grad=True)
    kept = torch.randn(cpu_offload.MIN_OFFLOAD_NUMEL, requires_grad=True)
    te.mark_not_offload(kept)
    weight = torch.nn.Parameter(torch.randn(cpu_offload.MIN_OFFLOAD_NUMEL))
    got = {}
    for name, t in (("big", big), ("kept", kept), ("weight", weight)):
        context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
        with context:
            y = (t * 2).exp()  # exp saves its output, a plain tensor from t
            y = y * t  # saves t itself
        y = sync(y)
        with context:
            y = y * 1.0
        y = sync(y)
        state = context.synchronizer.layer_states[0]
        got[name] = len(state.host)
        y.sum().backward()
    assert got == {"big": 3, "kept": 2, "weight": 2}  # exp result, y and t; t stays when marked or a parameter

    strided = torch.randn(2, cpu_offload.MIN_OFFLOAD_NUMEL, requires_grad=True)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    with pytest.warns(UserWarning, match="non-contiguous"):
        with context:
            y = strided.t().exp()  # saves its non-contiguous output
    assert context.synchronizer.layer_states[0].saved == []


def test_disabled_and_option_errors():
    context, sync = te.get_cpu_offload_context(enabled=False)
    assert sync is not None and sync(x := torch.ones(2)) is x
    assert len(te.get_cpu_offload_context(enabled=False, manual_synchronization=True)) == 3
    with pytest.raises(ValueError, match="num_layers"):
        te.get_cpu_offload_context(enabled=True, num_layers=3, model_layers=3)
    with pytest.raises(ValueError, match="neither activations nor weights"):
        te.get_cpu_offload_context(enabled=True, offload_activations=False, model_layers=2)
    with pytest.raises(ValueError, match="offload_stream"):
        te.get_cpu_offload_context(enabled=True, model_layers=2, offload_stream=object())
    with pytest.warns(DeprecationWarning, match="weights"):
        te.get_cpu_offload_context(enabled=True, model_layers=2, offload_weights=True)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    with pytest.raises(RuntimeError, match="entered again"):
        with context:
            with context:
                pass
    context.inside = False
    with pytest.raises(ValueError, match="requires grad"):
        sync(torch.ones(2))


@pytest.mark.cuda
def test_cuda_tensors_go_to_pinned_host_memory(small_threshold):
    model, x = _model(3).cuda(), torch.randn(8, WIDTH, device="cuda")
    reference, _ = _run(model, x)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3)
    _Probe.log.clear()
    leaf = x.clone().requires_grad_(True)
    h = leaf
    for layer in model:
        with context:
            h = layer(h)
        h = sync(h)
    host = context.synchronizer.layer_states[0].host
    assert host and all(t.device.type == "cpu" and t.is_pinned() for t in host)
    assert context.synchronizer.layer_states[0].saved == []  # dropped from the GPU
    h.square().sum().backward()
    grads = [leaf.grad] + [p.grad for p in model.parameters()]
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    entry = _Probe.log[0]
    assert entry["restored"] != entry["saved"] and entry["same_values"]
