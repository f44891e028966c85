"""`checkpoint`: activation recompute with Transformer Engine's signature.

The recompute repeats the FP8 forward exactly whichever checkpoint runs it (this one, or `torch.utils.checkpoint`
in either mode): see fp8kit.pytorch.recompute. What this function adds to torch's is TE's options: restoring the
named states of a `CudaRNGStatesTracker`, and, in reentrant mode, saving the first input split over a
tensor-parallel group (`distribute_saved_activations`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Optional, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint

from .recompute import checkpoint_region, reentrant_forward
from .rng import get_rng_state, set_rng_state

__all__ = ["checkpoint"]


def checkpoint(function: Callable, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group=None, use_reentrant: bool = True,
               **kwargs) -> Any:
    """Run `function(*args, **kwargs)` without keeping its activations; run it again during backward.

    function: the module or callable to checkpoint (fp8kit modules inside it recompute in FP8 with the scales of
      the forward they repeat, and record no amax).
    distribute_saved_activations: with `use_reentrant=True`, keep only this rank's 1/tp share of the first tensor
      argument (split over `tp_group`, the default group if None) and all-gather it for the recompute.
    get_rng_state_tracker: a callable returning a `CudaRNGStatesTracker` whose states the recompute restores.
    tp_group: the tensor-parallel group of `distribute_saved_activations`.
    use_reentrant: reentrant checkpointing (the default, as in Transformer Engine) or torch's non-reentrant one.
    kwargs: passed on to `function`; with `use_reentrant=False`, `context_fn`, `determinism_check`, `debug` and
      `preserve_rng_state` go to torch.utils.checkpoint.
    """
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {type(function).__name__}")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError("checkpoint: get_rng_state_tracker must be a callable returning a CudaRNGStatesTracker")
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"checkpoint: use_reentrant must be a bool, got {use_reentrant!r}")
    if use_reentrant:
        if distribute_saved_activations:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("checkpoint(distribute_saved_activations=True) needs torch.distributed to be "
                                   "initialised")
        return _ReentrantCheckpoint.apply(function, bool(distribute_saved_activations), get_rng_state_tracker,
                                          tp_group, kwargs, *args)
    if distribute_saved_activations:
        warnings.warn("checkpoint: distribute_saved_activations=True has no effect with use_reentrant=False (torch "
                      "keeps the inputs through autograd's saved-tensor hooks)", stacklevel=2)
    torch_options = {k: kwargs.pop(k) for k in ("context_fn", "determinism_check", "debug", "preserve_rng_state")
                     if k in kwargs}
    context_fn = torch_options.pop("context_fn", torch_checkpoint.noop_context_fn)
    if get_rng_state_tracker is not None:
        context_fn = _with_tracker_states(context_fn, get_rng_state_tracker)
    torch_options["context_fn"] = _with_regions(context_fn)
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **torch_options, **kwargs)


def _with_tracker_states(user_context_fn, get_tracker):
    """A `context_fn` for torch's non-reentrant checkpoint that also replays the tracker's named states."""

    def context_fn():
        user_forward, user_recompute = user_context_fn()
        saved = {}

        @contextlib.contextmanager
        def forward():
            saved["states"] = _copy_states(get_tracker().get_states())
            with user_forward:
                yield

        @contextlib.contextmanager
        def recompute():
            tracker = get_tracker()
            current = tracker.get_states()
            tracker.set_states(_copy_states(saved["states"]))
            try:
                with user_recompute:
                    yield
            finally:
                tracker.set_states(current)

        return forward(), recompute()

    return context_fn


def _with_regions(user_context_fn):
    """A `context_fn` that also marks the forward and the recompute (the recompute queries of Transformer Engine)."""

    def context_fn():
        user_forward, user_recompute = user_context_fn()
        return _entered(checkpoint_region("forward"), user_forward), \
            _entered(checkpoint_region("recompute"), user_recompute)

    return context_fn


@contextlib.contextmanager
def _entered(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def _copy_states(states):
    return {name: state.clone() for name, state in states.items()}


def _split_share(t: torch.Tensor, group) -> Tuple[torch.Tensor, int]:
    """This rank's share of `t` flattened and split into equal chunks over `group` (zero-padded)."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = t.detach().reshape(-1)
    chunk = -(-flat.numel() // size)
    padded = torch.nn.functional.pad(flat, (0, chunk * size - flat.numel()))
    return padded[rank * chunk:(rank + 1) * chunk].clone(), flat.numel()


def _gather_share(share: torch.Tensor, numel: int, shape, group) -> torch.Tensor:
    import torch.distributed as dist

    size = dist.get_world_size(group)
    out = torch.empty(share.numel() * size, dtype=share.dtype, device=share.device)
    dist.all_gather_into_tensor(out, share.contiguous(), group=group)
    return out[:numel].view(shape)


class _ReentrantCheckpoint(torch.autograd.Function):
    """Reentrant checkpoint: the forward runs under no_grad; backward runs the function again with grad and
    backpropagates through that second graph. RNG states (CPU, CUDA and the tracker's) are replayed."""

    @staticmethod
    def forward(ctx, function, distribute, get_tracker, tp_group, kwargs, *args):
        ctx.function, ctx.get_tracker, ctx.kwargs, ctx.distribute = function, get_tracker, kwargs, distribute
        ctx.tp_group = tp_group
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = get_rng_state()
        ctx.tracker_states = _copy_states(get_tracker().get_states()) if get_tracker is not None else None
        ctx.autocast = _torch_autocast_state()
        tensors, ctx.slots, ctx.others = [], [], []
        for i, a in enumerate(args):
            if torch.is_tensor(a):
                ctx.slots.append(i)
                tensors.append(a)
            ctx.others.append(None if torch.is_tensor(a) else a)
        ctx.requires = [t.requires_grad for t in tensors]
        ctx.first_shape = None
        if distribute and tensors:
            share, ctx.first_numel = _split_share(tensors[0], tp_group)
            ctx.first_shape = tensors[0].shape
            tensors[0] = share
        ctx.save_for_backward(*tensors)
        with torch.no_grad(), reentrant_forward(), checkpoint_region("forward"):
            return function(*args, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("fp8kit checkpoint(use_reentrant=True) does not support torch.autograd.grad or "
                               "backward(inputs=...); use use_reentrant=False")
        tensors = list(ctx.saved_tensors)
        if ctx.first_shape is not None:
            tensors[0] = _gather_share(tensors[0], ctx.first_numel, ctx.first_shape, ctx.tp_group)
        args = list(ctx.others)
        for i, t, requires in zip(ctx.slots, tensors, ctx.requires):
            d = t.detach()
            d.requires_grad_(requires)
            args[i] = d
        outputs = _replay(ctx, args)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if not pairs:
            raise RuntimeError("checkpoint: none of the function's outputs requires grad")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None, None) + tuple(a.grad if torch.is_tensor(a) else None for a in args)


def _torch_autocast_state():
    return [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda") if torch.amp.is_autocast_available(device)]


def _replay(ctx, args):
    """Run the function again with the forward's RNG states and torch.autocast settings, then restore."""
    cpu_now, device_now = torch.get_rng_state(), get_rng_state()
    tracker = ctx.get_tracker() if ctx.get_tracker is not None else None
    tracker_now = tracker.get_states() if tracker is not None else None
    torch.set_rng_state(ctx.cpu_state)
    set_rng_state(ctx.device_state)
    if tracker is not None:
        tracker.set_states(_copy_states(ctx.tracker_states))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            stack.enter_context(checkpoint_region("recompute"))
            for device, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            return ctx.function(*args, **ctx.kwargs)
    finally:
        torch.set_rng_state(cpu_now)
        set_rng_state(device_now)
        if tracker is not None:
            tracker.set_states(tracker_now)
