"""Activation offload to host memory with Transformer Engine's API: `te.get_cpu_offload_context(...)` and
`te.mark_not_offload(*tensors)`.

The context installs `torch.autograd.graph.saved_tensors_hooks`: a tensor that a layer saves for its backward is
recorded, copied to host memory after the layer's forward, dropped from the device, and copied back before the
layer's backward. As in Transformer Engine:
- layers are the forwards run inside the context, counted per iteration (`model_layers` per iteration);
- without manual synchronization the first `num_layers` layers are offloaded, layer i's copy starts when layer i + 1
  begins and must be finished when layer `model_layers - num_layers + i` begins; its reload starts when the backward
  reaches layer `model_layers - 1 - num_layers + i` (the last layer is never offloaded);
- with `manual_synchronization=True` a third return value drives it: `start_offload_layer(i)`,
  `release_activation_forward_gpu_memory(i)`, `start_reload_layer(i)`;
- only tensors of at least `MIN_OFFLOAD_NUMEL` elements are offloaded; parameters, tensors marked with
  `mark_not_offload`, non-contiguous tensors (with a warning) and FP8 tensors (`QuantizedTensor`, fp8kit keeps them
  on the device) stay where they are.

Where the copies go: a CUDA tensor to pinned host memory, on a side stream (or `offload_stream`), and back. A CPU
tensor is already in host memory; it is copied to a separate buffer all the same (no memory is saved, but the
mechanism runs and is tested on CPU) and that buffer is handed to the backward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from typing import Optional

import torch

from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage

__all__ = ["get_cpu_offload_context", "mark_not_offload", "is_cpu_offload_enabled"]

MIN_OFFLOAD_NUMEL = 256 * 1024  # smaller tensors stay (Transformer Engine's threshold: about 1 MB of float32)

_ACTIVE = []  # the synchronizers whose context is entered (is_cpu_offload_enabled)


def is_cpu_offload_enabled() -> bool:
    """True inside an enabled offload context."""
    return bool(_ACTIVE)


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """Keep these tensors on their device when a layer saves them inside an offload context."""
    for t in tensors:
        if t is not None:
            t._TE_do_not_offload = True


def _offloadable(t: torch.Tensor) -> bool:
    if (t.numel() < MIN_OFFLOAD_NUMEL or isinstance(t, (torch.nn.Parameter, QuantizedTensor, QuantizedTensorStorage))
            or getattr(t, "_TE_do_not_offload", False) or isinstance(t, torch._subclasses.FakeTensor)):
        return False
    if not t.is_contiguous():
        warnings.warn("Tried to offload a non-contiguous tensor, which is not supported; it stays on its device.")
        return False
    return True


class _LayerState:
    """The saved tensors of one layer: recorded -> offload started -> released -> reload started."""

    def __init__(self, stream, retain_buffers: bool):
        self.stream, self.retain_buffers = stream, retain_buffers
        self.saved, self.host, self.devices, self.reloaded, self.events = [], [], [], [], []
        self.state = "not_offloaded"

    def _expect(self, what: str, *states: str) -> None:
        if self.state not in states:
            raise RuntimeError(f"{what}: the layer is in state {self.state!r}, expected one of {list(states)}")

    def push(self, t: torch.Tensor):
        self._expect("saving a tensor", "not_offloaded")
        if not _offloadable(t):
            return t
        self.saved.append(t)
        return len(self.saved) - 1

    def pop(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        self._expect("using a saved tensor", "not_offloaded", "reload_started")
        if self.state == "not_offloaded":
            return self.saved[handle]
        if self.events[handle] is not None:
            torch.cuda.current_stream().wait_event(self.events[handle])
        return self.reloaded[handle]

    def start_offload(self) -> None:
        self._expect("start_offload", "not_offloaded")
        self.state = "offload_started"
        reuse = self.retain_buffers and len(self.host) == len(self.saved)
        if not reuse:
            self.host = []
        self.devices = [t.device for t in self.saved]
        for i, t in enumerate(self.saved):
            if reuse and self.host[i].shape != t.shape:
                raise ValueError(f"retain_pinned_cpu_buffers: saved tensor {i} has shape {tuple(t.shape)}, its "
                                 f"host buffer {tuple(self.host[i].shape)}; shapes must not change between iterations")
            if t.is_cuda:
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    buffer = self.host[i] if reuse else torch.empty_like(t, device="cpu", pin_memory=True)
                    buffer.copy_(t, non_blocking=True)
            else:
                buffer = self.host[i].copy_(t) if reuse else t.clone(memory_format=torch.contiguous_format)
            if not reuse:
                self.host.append(buffer)

    def release(self) -> None:
        """Drop the device tensors (after their copies finished)."""
        self._expect("release_activation_forward_gpu_memory", "offload_started")
        self.state = "offload_finished"
        if any(t.is_cuda for t in self.saved):
            torch.cuda.current_stream().wait_stream(self.stream)
        self.saved = []

    def start_reload(self) -> None:
        self._expect("start_reload", "offload_finished")
        self.state = "reload_started"
        self.reloaded, self.events = [], []
        for buffer, device in zip(self.host, self.devices):
            if device.type == "cuda":
                back = torch.empty_like(buffer, device=device)
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    back.copy_(buffer, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            else:  # already in host memory: the buffer itself goes to the backward
                back, event = buffer, None
            self.reloaded.append(back)
            self.events.append(event)

    def release_all(self) -> None:
        self.saved, self.reloaded, self.events = [], [], []
        if not self.retain_buffers:
            self.host = []
        self.state = "not_offloaded"

    def offloaded_mb(self) -> float:
        return sum(t.numel() * t.element_size() for t in self.host) / 2 ** 20


class _Synchronizer:
    """The layer states of one model and the layer counting (Transformer Engine's OffloadSynchronizer)."""

    def __init__(self, model_layers: int, retain_buffers: bool, stream):
        if stream is None and torch.cuda.is_available():
            stream = torch.cuda.Stream()
        self.num_layers = model_layers
        self.stream = stream
        self.layer_states = {i: _LayerState(stream, retain_buffers) for i in range(model_layers)}
        self.num_of_fwds = self.previous_bwd_layer_id = self.current_layer_id = None

    def fwd_step(self) -> int:
        if self.num_of_fwds in (None, self.num_layers - 1):  # a new iteration
            for state in self.layer_states.values():
                state.release_all()
            self.num_of_fwds = 0
        else:
            self.num_of_fwds += 1
        self.current_layer_id = self.num_of_fwds
        return self.current_layer_id

    def bwd_step(self, layer: int) -> None:
        if self.previous_bwd_layer_id is not None:
            self.layer_states[self.previous_bwd_layer_id].release_all()
        self.previous_bwd_layer_id = self.current_layer_id = layer

    def push_tensor(self, t):
        return self.layer_states[self.num_of_fwds].push(t)

    def pop_tensor(self, handle):
        return self.layer_states[self.current_layer_id].pop(handle)

    def finish_part_of_bwd(self) -> None:
        if self.previous_bwd_layer_id is not None:
            self.layer_states[self.previous_bwd_layer_id].release_all()
        self.previous_bwd_layer_id = None

    def get_offloaded_total_size_mb(self) -> float:
        """Host memory held by offloaded tensors, in MiB."""
        return sum(state.offloaded_mb() for state in self.layer_states.values())


class _DefaultSynchronizer(_Synchronizer):
    """Offloads layers 0 .. num_offloaded - 1 on a fixed schedule (see the module docstring)."""

    def __init__(self, model_layers: int, num_offloaded: int, retain_buffers: bool, stream):
        super().__init__(model_layers, retain_buffers, stream)
        self.offloaded = set(range(num_offloaded))
        self.finish_at, self.reload_at = defaultdict(list), defaultdict(list)
        for layer in self.offloaded:
            self.finish_at[model_layers - num_offloaded + layer].append(layer)
            self.reload_at[model_layers - 1 - num_offloaded + layer].append(layer)

    def fwd_step(self) -> int:
        layer = super().fwd_step()
        if layer - 1 in self.offloaded:
            self.layer_states[layer - 1].start_offload()
        for earlier in self.finish_at[layer]:
            self.layer_states[earlier].release()
        return layer

    def bwd_step(self, layer: int) -> None:
        super().bwd_step(layer)
        for later in self.reload_at[layer]:
            self.layer_states[later].start_reload()

    def push_tensor(self, t):
        if self.num_of_fwds not in self.offloaded:
            return t
        return super().push_tensor(t)


class ManualOffloadSynchronizer(_Synchronizer):
    """Offload driven by the caller: nothing moves unless these are called for a layer."""

    def start_offload_layer(self, layer_id: int) -> None:
        """Copy the layer's saved tensors to host memory."""
        self.layer_states[layer_id].start_offload()

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Wait for the layer's copies and drop its device tensors."""
        self.layer_states[layer_id].release()

    def start_reload_layer(self, layer_id: int) -> None:
        """Copy the layer's tensors back; each is waited for when the backward uses it."""
        self.layer_states[layer_id].start_reload()


class _OffloadContext(contextlib.ContextDecorator):
    """Entered around each layer's forward; `synchronization_function(output)` after it."""

    def __init__(self, synchronizer: _Synchronizer):
        self.synchronizer = synchronizer
        self.current_layer = None
        self.inside = False

    def __enter__(self):
        if self.inside:
            raise RuntimeError("the offload context was entered again before synchronization_function was called")
        self.inside = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.synchronizer.push_tensor,
                                                               self.synchronizer.pop_tensor)
        self._hooks.__enter__()
        _ACTIVE.append(self.synchronizer)
        self.current_layer = self.synchronizer.fwd_step()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        _ACTIVE.remove(self.synchronizer)
        self.inside = False
        return False

    def synchronization_function(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark `tensor` (the layer's output) so that the backward reaching it reloads what it needs."""
        if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad or tensor.grad_fn is None:
            raise ValueError("synchronization_function needs a tensor produced by the layer that requires grad, got "
                             f"{tensor.shape if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
        if self.current_layer is None or self.inside:
            raise RuntimeError("synchronization_function must be called after the offload context was left "
                               "(enter it around the layer's forward first)")
        layer, synchronizer = self.current_layer, self.synchronizer

        def hook(_grads):
            torch.autograd.Variable._execution_engine.queue_callback(synchronizer.finish_part_of_bwd)
            synchronizer.bwd_step(layer)

        tensor.grad_fn.register_prehook(hook)
        return tensor


def _passthrough(manual: bool):
    return (contextlib.nullcontext(), lambda x: x, None) if manual else (contextlib.nullcontext(), lambda x: x)


def get_cpu_offload_context(enabled: bool = False, num_layers: Optional[int] = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False, manual_synchronization: bool = False,
                            retain_pinned_cpu_buffers: bool = False, offload_stream=None):
    """`(context, synchronization_function)`, plus the manual controller when `manual_synchronization=True`.

    Use: `with context: x = layer(x)` then `x = synchronization_function(x)`, for each of the `model_layers` layers.
    `enabled=False` gives a context that does nothing. `offload_weights` and `double_buffering` are deprecated in
    Transformer Engine and have no effect (weights are parameters, never offloaded). `offload_stream` (CUDA, only
    with manual synchronization) is the stream the copies run on."""
    del double_buffering
    if not enabled:
        return _passthrough(manual_synchronization)
    if not offload_weights and not offload_activations:
        raise ValueError("get_cpu_offload_context: enabled, but neither activations nor weights are to be offloaded")
    if offload_weights:
        warnings.warn("Offloading weights is deprecated; offload_weights=True has no effect.", DeprecationWarning)
        if not offload_activations:
            return _passthrough(manual_synchronization)
    if model_layers < 1:
        raise ValueError(f"get_cpu_offload_context: model_layers must be at least 1, got {model_layers}")
    if not manual_synchronization:
        if num_layers is None or num_layers < 0 or num_layers > model_layers - 1:
            raise ValueError("get_cpu_offload_context: without manual synchronization num_layers must be in "
                             f"[0, model_layers - 1] (the last layer is not offloaded); got num_layers={num_layers}, "
                             f"model_layers={model_layers}")
        if num_layers == model_layers - 1:
            warnings.warn("Offloading num_layers == model_layers - 1 is not recommended: it leaves no overlap of "
                          "computation with offload and reload.")
        if offload_stream is not None:
            raise ValueError("get_cpu_offload_context: offload_stream can be given only with manual_synchronization")
        synchronizer = _DefaultSynchronizer(model_layers, num_layers, retain_pinned_cpu_buffers, None)
    else:
        synchronizer = ManualOffloadSynchronizer(model_layers, retain_pinned_cpu_buffers, offload_stream)
    context = _OffloadContext(synchronizer)
    if manual_synchronization:
        return context, context.synchronization_function, synchronizer
    return context, context.synchronization_function
