"""`make_graphed_callables`: Transformer Engine's CUDA-graph API for FP8 modules.

A graph replays kernels without running Python, so everything a step changes must be a tensor operation inside it:
the casts read the scales from the state tensors and record their amaxes into the staging rows. The bookkeeping
that an eager call does in Python (which states ran in the step, how many backwards are outstanding) is done by the
graphed callable itself at each replay, from the list of calls it saw while warming up:

- forward: each FP8 call of the callable is reported to the enclosing autocast step, which updates their forward
  states at its exit, as for eager calls;
- backward: once the replayed backward graph has run (a hook on its autograd node), each call's backward is
  reported done, and the last one of the step runs the backward update, as in eager.

The updates themselves run outside the graphs, with tensor operations on the same state tensors. A replayed step
therefore leaves the same histories, scales and counters as an eager step. Warm-up and capture change no state: the
states are restored in place (the graphs keep their addresses).

Devices: on CUDA the graphs are CUDA graphs (`torch.cuda.make_graphed_callables`). Elsewhere there are no CUDA
graphs; the callables are compiled with torch.compile (fullgraph, backend `CPU_BACKEND`), which replays a forward
and a backward graph without running the modules' Python either, with the same bookkeeping around it. The backend
is aot_eager: its graphs run the same aten operations as eager, so replays are bit-identical to eager steps
(inductor generates its own kernels, whose reductions round differently). Each capture compiles a function with a
code object of its own: dynamo keeps its compiled graphs, and counts them against `recompile_limit`, per code
object, so captures of many different modules in one process do not compete for one module class's entries.
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Callable, List, Optional

import torch

from ..recipe import DelayedScaling, Recipe
from .autocast import current_frame, entry_recipe, graph_capture_autocast
from .graph_schedule import canonical_hooks, run_hooks, schedule
from .modules.base import FP8StateMixin

__all__ = ["make_graphed_callables", "CPU_BACKEND"]

CPU_BACKEND = "aot_eager"  # torch.compile backend of the graphs on devices without CUDA graphs (bit-identical)


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    fp8_enabled=None,
    fp8_calibrating: Optional[bool] = None,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group=None,
    fp8_weight_caching: Optional[bool] = None,
    enabled=None,
    calibrating: Optional[bool] = None,
    recipe: Optional[Recipe] = None,
    amax_reduction_group=None,
    cache_quantized_params: Optional[bool] = None,
    _order: Optional[List[int]] = None,
    _num_layers_per_chunk: Optional[List[int]] = None,
    pool=None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    clone_param_grads_on_return: bool = True,
    pre_warmup_hook: Optional[Callable] = None,
    post_warmup_hook: Optional[Callable] = None,
    capture_time_hooks=None,
):
    """Graph `modules` (a torch.nn.Module or a tuple of them), each called with its `sample_args` (a tuple or list
    of tensors; a tuple of such for several modules), under FP8 as `enabled` / `recipe` say. Returns the modules
    (one or a tuple) with their forward replaced by the graphed one while in the training mode they had.

    Call the graphed modules inside `te.autocast(recipe=...)` with the recipe they were graphed with: the updates of
    their delayed-scaling states run at its exit and after their backward, as for eager modules. Transformer Engine's
    `fp8_*` argument names are accepted with its deprecation warning.

    Transformer Engine's options, on the CPU path (torch.compile graphs):
    - `cache_quantized_params` (`fp8_weight_caching`): every call of a graphed module must pass the
      `is_first_microbatch` bool (a ValueError says so otherwise), which the graph does not see. Under current
      scaling, or with FP8 weights, the weights' FP8 bytes of a later microbatch equal the cached ones (the weights
      do not change between microbatches), so each replay casts them again; under delayed scaling the cached bytes
      would carry the first microbatch's scale, which a replayed graph cannot keep: refused (NotImplementedError).
    - `_order`, `_num_layers_per_chunk`: the pipeline-parallel schedule (see fp8kit/pytorch/graph_schedule.py):
      warm-up and capture run the layers' forwards and backwards in that order, with one `sample_args` entry per
      (layer, microbatch); each layer is compiled once (its microbatches share the graph) and replays in any order.
      As in Transformer Engine the result is then one graphed forward function per `sample_args` entry (the modules'
      own forwards stay).
    - `capture_time_hooks`: per module, `{"forward_pre_hooks" | "forward_hooks" | "backward_pre_hooks" |
      "backward_hooks": {id: hook(module)}}`, called around each warm-up and capture forward / backward, never at
      replay.
    Not supported (an error says so): `_reuse_graph_input_output_buffers`, fractional `_order` entries, and on CUDA
    `sample_kwargs`, `_order`, `capture_time_hooks`, `cache_quantized_params`.
    """
    enabled = _renamed("fp8_enabled", fp8_enabled, "enabled", enabled, False)
    calibrating = _renamed("fp8_calibrating", fp8_calibrating, "calibrating", calibrating, False)
    recipe = _renamed("fp8_recipe", fp8_recipe, "recipe", recipe, None)
    amax_reduction_group = _renamed("fp8_group", fp8_group, "amax_reduction_group", amax_reduction_group, None)
    cache = _renamed("fp8_weight_caching", fp8_weight_caching, "cache_quantized_params", cache_quantized_params, False)
    if _reuse_graph_input_output_buffers:
        raise NotImplementedError("make_graphed_callables: _reuse_graph_input_output_buffers is not supported by "
                                  "fp8kit")
    single = not isinstance(modules, tuple)
    if single:
        modules, sample_args = (modules,), (sample_args,)
        sample_kwargs = (sample_kwargs,)
    elif sample_kwargs is None:
        sample_kwargs = (None,) * len(sample_args)
    if not isinstance(sample_args, (tuple, list)) \
            or not all(isinstance(a, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in a)
                       for a in sample_args):
        raise TypeError("make_graphed_callables: each sample_args entry must be a tuple (or list) of tensors")
    sample_args = tuple(tuple(a) for a in sample_args)
    if len(sample_kwargs) != len(sample_args):
        raise ValueError(f"make_graphed_callables: {len(sample_args)} sample_args but {len(sample_kwargs)} "
                         "sample_kwargs")
    steps = schedule(len(modules), len(sample_args), _order, _num_layers_per_chunk)
    hooks = canonical_hooks(len(modules), capture_time_hooks)
    if not isinstance(enabled, tuple):
        if not isinstance(enabled, bool):
            raise TypeError(f"make_graphed_callables: enabled must be a bool or a tuple of bools, got {enabled!r}")
        enabled = (enabled,) * len(modules)
    elif len(enabled) != len(modules):
        raise ValueError(f"make_graphed_callables: enabled has {len(enabled)} entries for {len(modules)} modules")
    if not isinstance(calibrating, bool):
        raise TypeError(f"make_graphed_callables: calibrating must be a bool, got {calibrating!r}")
    if any(enabled) or calibrating:
        recipe = entry_recipe(recipe, "make_graphed_callables")  # the fields at capture: replays check them
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"make_graphed_callables: graphing {type(module).__name__} is not supported; pass "
                            "torch.nn.Module instances")
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"make_graphed_callables: num_warmup_iters must be an int >= 1, got {num_warmup_iters!r}")
    if cache and isinstance(recipe, DelayedScaling) and (any(enabled) or calibrating):
        raise NotImplementedError(
            "make_graphed_callables: cache_quantized_params=True under DelayedScaling: the cached FP8 weights of "
            "later microbatches carry the first microbatch's scale, which fp8kit's replayed graphs cannot keep; "
            "use cache_quantized_params=False (the weights are cast at every replay) or Float8CurrentScaling")
    cuda = sample_args[0][0].is_cuda if sample_args[0] else False
    if cuda and (any(sample_kwargs) or _order is not None or capture_time_hooks is not None or cache):
        raise NotImplementedError("make_graphed_callables: sample_kwargs, _order, capture_time_hooks and "
                                  "cache_quantized_params are not supported on CUDA by fp8kit")

    saved = [_save_states(m) for m in modules]
    if pre_warmup_hook is not None:
        pre_warmup_hook()
    settings = [(en, calibrating, recipe if (en or calibrating) else None, amax_reduction_group) for en in enabled]
    calls = [None] * len(modules)
    forwards = [_eager_forward(m, s, calls, i) for i, (m, s) in enumerate(zip(modules, settings))]
    for _ in range(num_warmup_iters):
        _run_steps(steps, modules, forwards, sample_args, sample_kwargs, hooks)
    if post_warmup_hook is not None:
        post_warmup_hook()
    if cuda:
        replays = _capture_cuda(modules, sample_args, settings, num_warmup_iters, allow_unused_input, pool)
    else:
        replays = [_capture_compiled(m, s) for m, s in zip(modules, settings)]
        _run_steps(steps, modules, replays, sample_args, sample_kwargs, hooks)  # compiles the graphs
    for states in saved:
        _restore_states(states)

    out = []
    for module, replay, call_list, setting in zip(modules, replays, calls, settings):
        if cache:
            replay = _taking_first_microbatch(module, replay)
        forward = _replaying_forward(module, replay, call_list or [], setting, module.training)
        forward.reset = lambda: None
        forward.backward_dw = _backward_dw(module)
        if _order is None:
            module.forward, module.reset, module.backward_dw = forward, forward.reset, forward.backward_dw
        out.append(module if _order is None else forward)
    if _order is not None:  # as Transformer Engine: one graphed forward per (layer, microbatch) sample, in order
        layer_of = {sample: index for kind, index, sample in steps if kind == "fwd"}
        return tuple(out[layer_of[s]] for s in range(len(sample_args)))
    return out[0] if single else tuple(out)


def _renamed(old: str, old_value, new: str, new_value, default):
    if old_value is not None:
        if new_value is not None:
            raise ValueError(f"make_graphed_callables has deprecated `{old}` in favor of `{new}`, but both are set")
        warnings.warn(f"make_graphed_callables has deprecated `{old}` in favor of `{new}`", DeprecationWarning,
                      stacklevel=3)
        return old_value
    return default if new_value is None else new_value


# ---- FP8 state around warm-up and capture ------------------------------------------------------------------------

def _fp8_modules(module: torch.nn.Module) -> List[FP8StateMixin]:
    return [m for m in module.modules() if isinstance(m, FP8StateMixin)]


def _save_states(module: torch.nn.Module):
    """(module, {pass name: (state, history, scale, count) copies}) for each FP8 module inside."""
    saved = []
    for m in _fp8_modules(module):
        copies = {}
        for name in ("scaling_fwd", "scaling_bwd"):
            state = m.fp8_meta[name]
            if state is not None:
                copies[name] = (state, state.amax_history.clone(), state.scale.clone(), state.count.clone())
        saved.append((m, copies))
    return saved


def _restore_states(saved) -> None:
    """Put back what warm-up and capture changed, in place (a captured graph holds the tensors' addresses); states
    they created start fresh (zero history, scale 1), as an eager module's do."""
    with torch.no_grad():
        for module, copies in saved:
            for name in ("scaling_fwd", "scaling_bwd"):
                state = module.fp8_meta[name]
                if state is None:
                    continue
                if name not in copies:
                    state.amax_history.zero_()
                    state.scale.fill_(1.0)
                    state.count.zero_()
                    continue
                old, history, scale, count = copies[name]
                if old is not state or state.history_len != history.shape[0]:
                    raise RuntimeError(f"make_graphed_callables: warm-up replaced the FP8 state of "
                                       f"{type(module).__name__}; graph it under the recipe it last ran with")
                state.amax_history.copy_(history)
                state.scale.copy_(scale)
                state.count.copy_(count)


# ---- warm-up: eager calls under the capture autocast, which also lists the FP8 calls ----------------------------

def _eager_forward(module, setting, calls: list, index: int):
    """The module's eager forward under the capture autocast; its first call lists the FP8 calls of one forward
    into `calls[index]` as [(module, needs_backward)]."""
    def forward(*args, **kwargs):
        with graph_capture_autocast(*setting) as step:
            out = module(*args, **kwargs)
        if calls[index] is None:
            calls[index] = step.graph_calls
        return out

    return forward


def _run_steps(steps, modules, forwards, sample_args, sample_kwargs, hooks) -> None:
    """One pass of the warm-up / capture schedule: forwards and backwards in order, hooks around each."""
    outputs = {}
    for kind, index, sample in steps:
        module = modules[index]
        if kind == "fwd":
            run_hooks(hooks, index, "forward_pre_hooks", module)
            outputs[sample] = forwards[index](*sample_args[sample], **(sample_kwargs[sample] or {}))
            run_hooks(hooks, index, "forward_hooks", module)
        elif module.training:
            run_hooks(hooks, index, "backward_pre_hooks", module)
            _backward(module, sample_args[sample], outputs.pop(sample))
            run_hooks(hooks, index, "backward_hooks", module)


def _backward(module, args, out) -> None:
    outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
               if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [a for a in args if a.requires_grad] + [p for p in module.parameters() if p.requires_grad]
    if outputs and inputs:
        torch.autograd.grad(outputs, inputs, [torch.ones_like(o) for o in outputs], allow_unused=True)


# ---- capture -----------------------------------------------------------------------------------------------------

def _capture_compiled(module, setting):
    """A forward and a backward graph from torch.compile (devices without CUDA graphs), compiled at the first call.
    The compiled function has a code object of its own (see the module docstring)."""
    compiled = torch.compile(_own_code(module.forward), fullgraph=True, backend=CPU_BACKEND)

    def replay(*a, **k):
        with graph_capture_autocast(*setting):
            return compiled(*a, **k)

    return replay


def _own_code(forward: Callable) -> Callable:
    """A function calling `forward`, with a code object no other function has."""
    def graphed_forward(*args, **kwargs):
        return forward(*args, **kwargs)

    code = graphed_forward.__code__.replace()  # a copy: dynamo's cache lives on the code object
    return types.FunctionType(code, graphed_forward.__globals__, "graphed_forward", None, graphed_forward.__closure__)


def _taking_first_microbatch(module, replay):
    """cache_quantized_params=True: each call names `is_first_microbatch` (a bool), which the graph does not take
    (see make_graphed_callables)."""
    def forward(*args, is_first_microbatch=None, **kwargs):
        if not isinstance(is_first_microbatch, bool):
            raise ValueError(f"the graphed {type(module).__name__} was made with cache_quantized_params=True: pass "
                             f"is_first_microbatch=True/False, got {is_first_microbatch!r}")
        return replay(*args, **kwargs)

    return forward


def _capture_cuda(modules, sample_args, settings, iters, allow_unused_input, pool):
    """CUDA graphs from torch.cuda.make_graphed_callables, captured under the capture autocast."""
    originals = [m.forward for m in modules]
    for module, original, setting in zip(modules, originals, settings):
        def captured(*a, _original=original, _setting=setting, **k):
            with graph_capture_autocast(*_setting):
                return _original(*a, **k)

        module.forward = captured
    try:
        graphed = torch.cuda.make_graphed_callables(tuple(modules), tuple(sample_args), num_warmup_iters=iters,
                                                    allow_unused_input=allow_unused_input, pool=pool)
    finally:
        replays = [m.forward for m in modules]
        for module, original in zip(modules, originals):
            module.forward = original
    del graphed
    return replays


# ---- replay ------------------------------------------------------------------------------------------------------

def _replaying_forward(module, replay, calls, setting, training: bool):
    """The module's new forward: the graph in the training mode it was captured in, with the step bookkeeping of
    its FP8 calls around it; the module's own forward otherwise."""
    eager_forward = module.forward
    enabled, calibrating, recipe, group = setting
    tracked = isinstance(recipe, DelayedScaling) and bool(calls)

    def forward(*args, **kwargs):
        if module.training != training:
            return eager_forward(*args, **kwargs)
        if not tracked:
            return replay(*args, **kwargs)
        frame = current_frame()
        grad = torch.is_grad_enabled()
        if frame is None or frame.graph or not (frame.enabled or frame.records_amax):
            if grad:
                raise RuntimeError(
                    f"fp8kit: the graphed {type(module).__name__} runs FP8 with delayed scaling; call it inside "
                    "te.autocast(recipe=...) with the recipe it was graphed with, whose exit updates its scales")
            return replay(*args, **kwargs)
        if frame.recipe != recipe or frame.group is not group:
            raise ValueError(f"fp8kit: the graphed {type(module).__name__} was captured with recipe {recipe} and "
                             f"amax_reduction_group {group!r}; it runs under {frame.recipe} and {frame.group!r}")
        step = frame.step
        counted = []
        for m, needs_backward in calls:
            m.fp8_states(frame, m.fp8_meta["scaling_fwd"].scale.device)  # registered under the frame's key
            counts = needs_backward and grad
            step.forward_called(frame.key, counts)
            counted.append(counts)
        out = replay(*args, **kwargs)
        pending = sum(counted)
        if pending:
            node = _grad_fn(out)
            if node is None:  # no output needs a gradient: no backward will come
                for _ in range(pending):
                    step.backward_done()
            else:
                node.register_hook(lambda *_: [step.backward_done() for _ in range(pending)] and None)
        return out

    return forward


def _grad_fn(out) -> Optional[Any]:
    for o in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(o, torch.Tensor) and o.grad_fn is not None:
            return o.grad_fn
    return None


def _backward_dw(module) -> Callable[[], None]:
    def backward_dw() -> None:
        for m in module.modules():
            if isinstance(m, FP8StateMixin) and hasattr(m, "backward_dw") and m is not module:
                m.backward_dw()

    return backward_dw

