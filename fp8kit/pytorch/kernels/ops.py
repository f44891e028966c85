"""Host side of the Triton kernels: checks, allocation and launches. Imports torch only (Triton is reached through
`fp8kit.pytorch.kernels.kernel_module` at the first call).

Every function here gives the same bytes as the torch path (`fp8kit.pytorch.cast`, `fp8kit.pytorch.state`); the
launch counts are in docs/kernels.md.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Optional, Sequence, Tuple

import torch

_FP8 = {torch.float8_e4m3fn: (448.0, True), torch.float8_e5m2: (57344.0, False)}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CAST_BLOCK = 64  # cast tiles are CAST_BLOCK x CAST_BLOCK (not tuned on hardware yet)
AMAX_BLOCK = 4096
_TABLE_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_TABLE_CACHE_SIZE = 64


def _module(device: torch.device):
    from . import interpreter_on, kernel_module

    if device.type == "cuda":
        return kernel_module(False)
    if device.type == "cpu":
        if not interpreter_on():
            raise RuntimeError("fp8kit Triton kernels run on CPU tensors only in Triton's interpreter: set "
                               "TRITON_INTERPRET=1")
        return kernel_module(True)
    raise RuntimeError(f"fp8kit Triton kernels: unsupported device {device}")


def _quiet(device: torch.device):
    """The interpreter computes in NumPy, which warns on the divisions by 0 and overflows the kernels handle."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    import numpy as np

    return np.errstate(divide="ignore", over="ignore", invalid="ignore")


def _check_x(x: torch.Tensor, where: str) -> Tuple[int, int]:
    """(M, N) of `x` seen as a row-major 2-D [prod(shape[:-1]), shape[-1]] (a 0-d tensor is [1, 1])."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{where}: x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if not x.is_contiguous():
        raise ValueError(f"{where}: x must be contiguous")
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


def _check_scalar(t: torch.Tensor, x: torch.Tensor, name: str, where: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1 or t.device != x.device:
        raise TypeError(f"{where}: {name} must be a float32 tensor with one element on {x.device}")


def _fp8(fp8_dtype: torch.dtype, where: str) -> Tuple[float, bool]:
    if fp8_dtype not in _FP8:
        raise TypeError(f"{where}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    return _FP8[fp8_dtype]


def _outputs(x, m, n, fp8_dtype, transpose):
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    data_t = torch.empty((n, m), dtype=fp8_dtype, device=x.device) if transpose else None
    return data, data_t


def _launch(kernel, grid, device: torch.device, *args, **constexprs) -> None:
    with _quiet(device):
        kernel[grid](*args, **constexprs)


def _launch_cast(x, m, n, data, data_t, fp8_dtype, *, scale=None, amax_buf=None, with_amax=False, scale_out=None,
                 scale_inv_out=None, scaled_max=0.0, eps=0.0, power_2=False):
    fp8_max, e4m3 = _FP8[fp8_dtype]
    q = data.view(torch.uint8)
    dummy = q  # stands for the pointers a variant does not use
    _launch(
        _module(x.device).cast_kernel, (_cdiv(m, CAST_BLOCK), _cdiv(n, CAST_BLOCK)), x.device,
        x, q, data_t.view(torch.uint8) if data_t is not None else dummy,
        scale if scale is not None else dummy,
        amax_buf if amax_buf is not None else dummy,
        amax_buf.view(torch.int32) if amax_buf is not None else dummy,
        scale_out if scale_out is not None else dummy,
        scale_inv_out if scale_inv_out is not None else dummy,
        m, n, float(scaled_max), float(eps),
        FP8_MAX=fp8_max, E4M3=e4m3, TRANSPOSE=data_t is not None, AMAX=with_amax,
        SCALE_FROM_AMAX=scale is None, POW2=bool(power_2), WRITE_SCALE=scale_out is not None,
        WRITE_SCALE_INV=scale_inv_out is not None, BLOCK_M=CAST_BLOCK, BLOCK_N=CAST_BLOCK,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cast_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool = False,
              amax_out: Optional[torch.Tensor] = None, scale_inv_out: Optional[torch.Tensor] = None):
    """Delayed-scaling cast in ONE kernel launch that reads `x` once.

    Takes `x` (float32/bfloat16/float16, contiguous, any shape; seen as [M, N] = [prod(shape[:-1]), shape[-1]]),
    `scale` (float32, one element, on x's device; read in the kernel, no host sync), the FP8 dtype, `transpose`,
    `amax_out` (optional float32 one-element tensor, e.g. the staging slot `state.amax_history[0, slot]`: the
    tensor's amax is max-accumulated into it NaN-ignoring, as `ScalingState.record` does with `torch.fmax`) and
    `scale_inv_out` (optional float32 one-element tensor that gets `float32(1 / scale)`).
    Returns `(data, data_t, amax)`: FP8 `data` with x's shape, `data_t` [N, M] contiguous or None, and the amax
    tensor: `amax_out` when given (then it holds the accumulated value), else a fresh 0-d float32 with max|x|.
    Without `amax_out` the fresh buffer is zero-filled first (one `torch.zeros`).
    """
    where = "kernels.cast_amax"
    m, n = _check_x(x, where)
    _fp8(fp8_dtype, where)
    _check_scalar(scale, x, "scale", where)
    if amax_out is not None:
        _check_scalar(amax_out, x, "amax_out", where)
        if not amax_out.is_contiguous():
            raise ValueError(f"{where}: amax_out must be contiguous")
    if scale_inv_out is not None:
        _check_scalar(scale_inv_out, x, "scale_inv_out", where)
    data, data_t = _outputs(x, m, n, fp8_dtype, transpose)
    amax_buf = amax_out if amax_out is not None else torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        if amax_out is not None:
            amax_out.copy_(torch.fmax(amax_out, torch.zeros_like(amax_out)))
        if scale_inv_out is not None:
            scale_inv_out.copy_(torch.reciprocal(scale).reshape(scale_inv_out.shape))
        return data, data_t, amax_buf
    _launch_cast(x, m, n, data, data_t, fp8_dtype, scale=scale, amax_buf=amax_buf, with_amax=True,
                 scale_inv_out=scale_inv_out)
    return data, data_t, amax_buf


def cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool = False,
         scale_inv_out: Optional[torch.Tensor] = None):
    """Cast (+ transpose) with a known scale, no amax: one kernel launch.

    Takes the same `x`, `scale`, `fp8_dtype`, `transpose`, `scale_inv_out` as `cast_amax`.
    Returns `(data, data_t)`: FP8 `data` with x's shape and `data_t` [N, M] contiguous or None.
    """
    where = "kernels.cast"
    m, n = _check_x(x, where)
    _fp8(fp8_dtype, where)
    _check_scalar(scale, x, "scale", where)
    if scale_inv_out is not None:
        _check_scalar(scale_inv_out, x, "scale_inv_out", where)
    data, data_t = _outputs(x, m, n, fp8_dtype, transpose)
    if x.numel() == 0:
        if scale_inv_out is not None:
            scale_inv_out.copy_(torch.reciprocal(scale).reshape(scale_inv_out.shape))
        return data, data_t
    _launch_cast(x, m, n, data, data_t, fp8_dtype, scale=scale, scale_inv_out=scale_inv_out)
    return data, data_t


def amax(x: torch.Tensor) -> torch.Tensor:
    """`max |x|` over the non-NaN elements of `x` (float32/bfloat16/float16, contiguous, any shape) as a 0-d
    float32 tensor (0 for an empty or all-NaN tensor). One zero-fill plus one kernel launch."""
    _check_x(x, "kernels.amax")
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out
    _launch(_module(x.device).amax_kernel, (_cdiv(x.numel(), AMAX_BLOCK),), x.device, x, out, out.view(torch.int32),
            x.numel(), BLOCK=AMAX_BLOCK)
    return out


def current_cast(x: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float = 0.0, power_2: bool = False,
                 transpose: bool = False, group=None):
    """Current scaling (SPEC section 3): the amax pass, an optional all-reduce (MAX) of the amax over `group`, then
    one cast pass that computes the scale in the kernel from the amax and writes it with its inverse.

    Takes `x` as in `cast_amax`, the FP8 dtype, `amax_epsilon` (finite, >= 0), `power_2`, `transpose`, and a
    torch.distributed process group or None.
    Returns `(data, data_t, scale, scale_inv, amax)`; the last three are 0-d float32 tensors (amax after the
    reduction, before the epsilon). Two kernel launches (plus the amax zero-fill).
    """
    where = "kernels.current_cast"
    m, n = _check_x(x, where)
    fp8_max, _ = _fp8(fp8_dtype, where)
    a = amax(x)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    data, data_t = _outputs(x, m, n, fp8_dtype, transpose)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        from ..cast import scale_from_amax  # lazy: no import cycle with fp8kit.pytorch.cast

        clamped = torch.clamp_min(a, amax_epsilon) if amax_epsilon > 0 else a
        scale.copy_(scale_from_amax(clamped, fp8_max, torch.ones_like(a), power_2))
        scale_inv.copy_(torch.reciprocal(scale))
        return data, data_t, scale, scale_inv, a
    _launch_cast(x, m, n, data, data_t, fp8_dtype, amax_buf=a, scale_out=scale, scale_inv_out=scale_inv,
                 scaled_max=fp8_max, eps=amax_epsilon, power_2=power_2)
    return data, data_t, scale, scale_inv, a


def _recipe_args(recipe, fp8_max: float, where: str):
    if recipe.uses_callables:
        raise ValueError(f"{where}: recipes with callable amax_compute_algo or scaling_factor_compute_algo run on "
                         "the torch path (fp8kit.pytorch.state.compute_update)")
    if recipe.amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"{where}: unsupported amax_compute_algo {recipe.amax_compute_algo!r}")
    return recipe.scaled_max(float(fp8_max)), recipe.amax_compute_algo == "most_recent", recipe.power_2_scale


def _check_f32(t: torch.Tensor, name: str, where: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous():
        raise TypeError(f"{where}: {name} must be a contiguous float32 tensor")


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
    _launch(_module(history.device).update_kernel, (_cdiv(n, block_n),), history.device, history, scale, mask, n,
            length, scaled_max, HAS_MASK=recompute is not None, MOST_RECENT=most_recent, POW2=pow2,
            BLOCK_N=block_n, BLOCK_L=block_l)
    return history, scale


def _table(device, histories, scales, flags) -> torch.Tensor:
    key = (str(device), tuple(h.data_ptr() for h in histories), tuple(s.data_ptr() for s in scales),
           tuple(s.numel() for s in scales), flags)
    table = _TABLE_CACHE.get(key)
    if table is not None:
        _TABLE_CACHE.move_to_end(key)
        return table
    rows = [list(key[1]), list(key[2]), list(key[3]), list(flags)]
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    _TABLE_CACHE[key] = table
    while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return table


def update_tensors(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], recipe, fp8_max: float,
                   recompute: Optional[Sequence[bool]] = None) -> None:
    """The batched update of many states IN PLACE in one kernel launch, without concatenating them.

    Takes per-state `histories` (float32 [L, n_k], contiguous, one L for all), `scales` (float32 [n_k],
    contiguous), all on one device; the recipe and fp8_max as in `update`; `recompute` (one bool per state, or
    None for all True). The kernel reads each state's addresses from an int64 table [4, K], built on the host and
    copied to the device once per distinct (addresses, sizes, flags) and then cached. Returns None.
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
    flags = tuple(1 for _ in histories) if recompute is None else tuple(int(bool(f)) for f in recompute)
    if len(flags) != len(histories):
        raise ValueError(f"{where}: recompute has {len(flags)} flags for {len(histories)} states")
    if length == 0:
        return
    table = _table(device, histories, scales, flags)
    block_n = min(_pow2_at_least(max(s.numel() for s in scales), 2), 64)
    block_l = min(max(1024 // block_n, 2), _pow2_at_least(length - 1, 2))
    _launch(_module(device).update_table_kernel, (len(histories),), device, table, len(histories), length,
            scaled_max, MOST_RECENT=most_recent, POW2=pow2, BLOCK_N=block_n, BLOCK_L=block_l)
