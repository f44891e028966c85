"""Host side of the delayed-scaling update kernels (SPEC section 5): checks and launches.

`update_tensors` passes each state's addresses as kernel arguments (UPDATE_CHUNK states per launch), as Transformer
Engine's multi-tensor kernels do: nothing is copied from the host to the device, so there is no host sync and a CUDA
graph can capture it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .launch import cdiv, launch

UPDATE_CHUNK = 32  # states per launch of update_tensors (the kernel's argument tuples have this length)


def _recipe_args(recipe, fp8_max: float, where: str):
    if recipe.uses_callables:
        raise ValueError(f"{where}: recipes with callable amax_compute_algo or scaling_factor_compute_algo run on "
                         "the torch path (fp8kit.pytorch.state.compute_update)")
    if recipe.amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"{where}: unsupported amax_compute_algo {recipe.amax_compute_algo!r}")
    return recipe.scaled_max(float(fp8_max)), recipe.amax_compute_algo == "most_recent", recipe.power_2_scale


def _check_f32(t, name: str, where: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous():
        raise TypeError(f"{where}: {name} must be a contiguous float32 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")


def _pow2_at_least(v: int, lo: int) -> int:
    p = lo
    while p < v:
        p *= 2
    return p


def update(history: torch.Tensor, scale: torch.Tensor, recipe, fp8_max: float,
           recompute: Optional[torch.Tensor] = None):
    """The batched delayed-scaling update (SPEC section 5), IN PLACE, in one kernel launch.

    Takes `history` (float32 [L, N], contiguous; row 0 holds the staging values), `scale` (float32 [N],
    contiguous), a DelayedScaling `recipe` without callables, `fp8_max` of the pass's format, and `recompute`
    (bool [N] on the same device, or None for all True: columns whose scale may change, for `interval`).
    Returns `(history, scale)`, the same tensors, updated as `fp8kit.pytorch.state.compute_update` would.
    """
    where = "kernels.update"
    _check_f32(history, "history", where)
    _check_f32(scale, "scale", where)
    if history.dim() != 2 or scale.shape != (history.shape[1],) or scale.device != history.device:
        raise ValueError(f"{where}: expected history [L, N] and scale [N] on one device, got "
                         f"{tuple(history.shape)} and {tuple(scale.shape)}")
    scaled_max, most_recent, pow2 = _recipe_args(recipe, fp8_max, where)
    length, n = history.shape
    if n == 0 or length == 0:
        return history, scale
    if recompute is not None:
        if recompute.dtype != torch.bool or recompute.shape != (n,) or recompute.device != history.device:
            raise TypeError(f"{where}: recompute must be a bool tensor of shape [{n}] on {history.device}")
        mask = recompute.contiguous().view(torch.int8)
    else:
        mask = scale
    block_n, block_l = 32, min(32, _pow2_at_least(length - 1, 2))
    launch("update_kernel", (cdiv(n, block_n),), history.device, (history, scale, mask, n, length, scaled_max),
           dict(HAS_MASK=recompute is not None, MOST_RECENT=most_recent, POW2=pow2, BLOCK_N=block_n,
                BLOCK_L=block_l))
    return history, scale


def update_tensors(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], recipe, fp8_max: float,
                   recompute: Optional[Sequence[bool]] = None) -> None:
    """The batched update of many states IN PLACE, without concatenating them: one kernel launch per UPDATE_CHUNK
    states.

    Takes per-state `histories` (float32 [L, n_k], contiguous, one L for all), `scales` (float32 [n_k],
    contiguous), all on one device; the recipe and fp8_max as in `update`; `recompute` (one bool per state, or
    None for all True). The addresses, widths and flags travel as kernel arguments: no host-to-device copy, no host
    synchronisation. Returns None.
    """
    where = "kernels.update_tensors"
    if len(histories) != len(scales):
        raise ValueError(f"{where}: {len(histories)} histories but {len(scales)} scales")
    if not histories:
        return
    scaled_max, most_recent, pow2 = _recipe_args(recipe, fp8_max, where)
    device, length = histories[0].device, histories[0].shape[0]
    for h, s in zip(histories, scales):
        _check_f32(h, "every history", where)
        _check_f32(s, "every scale", where)
        if h.dim() != 2 or h.shape[0] != length or s.shape != (h.shape[1],) or h.device != device \
                or s.device != device:
            raise ValueError(f"{where}: every history must be [{length}, n] with a scale [n] on {device}, got "
                             f"{tuple(h.shape)} and {tuple(s.shape)}")
    flags = [1] * len(histories) if recompute is None else [int(bool(f)) for f in recompute]
    if len(flags) != len(histories):
        raise ValueError(f"{where}: recompute has {len(flags)} flags for {len(histories)} states")
    if length == 0:
        return
    block_n = min(_pow2_at_least(max(s.numel() for s in scales), 2), 64)
    block_l = min(max(1024 // block_n, 2), _pow2_at_least(length - 1, 2))
    meta = device.type == "meta"  # meta tensors have no addresses; the launch records and runs nothing
    for start in range(0, len(histories), UPDATE_CHUNK):
        hs, ss = histories[start:start + UPDATE_CHUNK], scales[start:start + UPDATE_CHUNK]
        count = len(hs)
        pad = UPDATE_CHUNK - count  # unused entries repeat the last state (same types, never selected)
        addr_h = [0 if meta else h.data_ptr() for h in hs]
        addr_s = [0 if meta else s.data_ptr() for s in ss]
        widths = [s.numel() for s in ss]
        chunk_flags = flags[start:start + count]
        args = tuple(tuple(v + v[-1:] * pad) for v in (addr_h, addr_s, widths, chunk_flags))
        launch("update_states_kernel", (count,), device, args + (length, scaled_max),
               dict(MOST_RECENT=most_recent, POW2=pow2, CHUNK=UPDATE_CHUNK, BLOCK_N=block_n, BLOCK_L=block_l))
