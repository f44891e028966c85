"""The order in which `make_graphed_callables` runs its callables while warming up and capturing, and the
capture-time hooks it runs around them (Transformer Engine's `_order`, `_num_layers_per_chunk` and
`capture_time_hooks`).

Without `_order`: every callable's forward in the given order, then their backwards in reverse order, one sample
(`sample_args` entry) per callable. With `_order` (Megatron-core's interleaved pipeline-parallel schedule): the
callables are layers grouped into model chunks (`_num_layers_per_chunk`, or equal chunks), `_order` lists chunk
numbers (1-based) in execution order, positive for a forward of all the chunk's layers on the chunk's next
microbatch and negative for the backward of its oldest outstanding one (layers in reverse); `sample_args` holds one
entry per (layer, microbatch) forward, chunk by chunk, microbatch by microbatch within a chunk, as in Transformer
Engine.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["HOOK_NAMES", "schedule", "canonical_hooks", "run_hooks"]

HOOK_NAMES = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")

Step = Tuple[str, int, int]  # ("fwd" | "bwd", callable index, sample index)


def schedule(num_callables: int, num_samples: int, order: Optional[Sequence[int]],
             layers_per_chunk) -> List[Step]:
    """The warm-up / capture order as (kind, callable, sample) steps; checks the sizes as Transformer Engine does."""
    if order is None:
        if num_samples != num_callables:
            raise ValueError(f"make_graphed_callables: {num_callables} modules but {num_samples} sample_args")
        return [("fwd", i, i) for i in range(num_callables)] + [("bwd", i, i) for i in reversed(range(num_callables))]
    order = list(order)
    if any(math.ceil(c) != c for c in order):
        raise NotImplementedError("make_graphed_callables: fractional _order entries (delayed weight-gradient "
                                  "computation) are not supported by fp8kit")
    if not order or any(not isinstance(c, int) or c == 0 for c in order):
        raise ValueError(f"make_graphed_callables: _order must list nonzero ints (chunk numbers), got {order}")
    chunks = max(order)
    microbatches = len(order) // chunks // 2
    if chunks * microbatches * 2 != len(order) or sorted(order) != sorted(
            [c for c in range(1, chunks + 1) for _ in range(microbatches)]
            + [-c for c in range(1, chunks + 1) for _ in range(microbatches)]):
        raise ValueError(f"make_graphed_callables: _order {order} must hold each chunk 1..{chunks} forward (+) and "
                         f"backward (-) the same number of times")
    if layers_per_chunk is None:
        if num_samples % (chunks * microbatches):
            raise ValueError(f"make_graphed_callables: {num_samples} sample_args do not divide into {chunks} chunks "
                             f"x {microbatches} microbatches")
        layers_per_chunk = [num_samples // chunks // microbatches] * chunks
    elif isinstance(layers_per_chunk, int):
        layers_per_chunk = [layers_per_chunk] * chunks
    elif len(layers_per_chunk) != chunks:
        raise ValueError(f"make_graphed_callables: _num_layers_per_chunk must be an int or {chunks} ints, got "
                         f"{layers_per_chunk}")
    total = sum(layers_per_chunk)
    if num_callables != total:
        raise ValueError(f"make_graphed_callables: _order describes {total} layers but {num_callables} modules "
                         "were given")
    if num_samples != total * microbatches:
        raise ValueError(f"make_graphed_callables: expected {total * microbatches} sample_args ({total} layers x "
                         f"{microbatches} microbatches), got {num_samples}")
    first = [sum(layers_per_chunk[:c]) for c in range(chunks)]
    done = {"fwd": [0] * chunks, "bwd": [0] * chunks}
    steps: List[Step] = []
    for c_id in order:
        kind, chunk = ("fwd", c_id - 1) if c_id > 0 else ("bwd", -c_id - 1)
        if kind == "bwd" and done["bwd"][chunk] >= done["fwd"][chunk]:
            raise ValueError(f"make_graphed_callables: _order runs a backward of chunk {chunk + 1} before its forward")
        layers = range(layers_per_chunk[chunk])
        for layer in (layers if kind == "fwd" else reversed(layers)):
            sample = first[chunk] * microbatches + done[kind][chunk] * layers_per_chunk[chunk] + layer
            steps.append((kind, first[chunk] + layer, sample))
        done[kind][chunk] += 1
    return steps


def canonical_hooks(num_callables: int, hooks) -> List[Dict[str, Dict]]:
    """One dict per callable with all four hook names (missing ones empty); checks the keys."""
    if hooks is None:
        return [{name: {} for name in HOOK_NAMES} for _ in range(num_callables)]
    if len(hooks) != num_callables:
        raise ValueError(f"make_graphed_callables: capture_time_hooks has {len(hooks)} entries for "
                         f"{num_callables} modules")
    out = []
    for entry in hooks:
        entry = entry or {}
        unknown = set(entry) - set(HOOK_NAMES)
        if unknown:
            raise ValueError(f"make_graphed_callables: unknown capture_time_hooks keys {sorted(unknown)}; expected "
                             f"some of {HOOK_NAMES}")
        out.append({name: dict(entry.get(name, {})) for name in HOOK_NAMES})
    return out


def run_hooks(hooks: List[Dict[str, Dict]], index: int, name: str, module) -> None:
    """Call the capture-time hooks `name` of callable `index` with its module (outside any graph)."""
    for hook in hooks[index][name].values():
        if hook(module) is not None:
            raise RuntimeError(f"make_graphed_callables: capture_time_hooks {name} must return None")
