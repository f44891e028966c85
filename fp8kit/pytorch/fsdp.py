"""FSDP2 (`torch.distributed.fsdp.fully_shard`) with FP8 weights: the all-gather sends the FP8 bytes.

A model built under `quantized_model_init` holds Float8Tensor weight parameters; `fully_shard` splits each along dim 0
(every rank keeps a Float8Tensor shard: its FP8 bytes and the tensor's one scale) and, before each forward and
backward, calls the all-gather extension of torch's FSDP2 (`fsdp_pre_all_gather` / `fsdp_post_all_gather`, methods
of Float8Tensor that run what this module registers with it when imported). So one byte per element goes over the
wire instead of two (bf16) or four (float32), and the forward receives the gathered Float8Tensor, whose bytes the
FP8 GEMM uses without a cast.

One scale for all shards: the gathered bytes are read with one `scale_inv`, so every rank must quantize its shard with
the same scale.
- Current scaling: at the first all-gather the weight's quantizer is replaced by a copy that all-reduces (MAX) its amax
  over the FSDP mesh group, so every later quantization of a shard (the optimizer's `param.quantize_(master)`, or an
  in-place update) computes the scale of the whole weight, identically on every rank (as Transformer Engine's
  `amax_reduction_group` on a sharded Float8Tensor).
- Delayed scaling: the shards are cast with the scale of the module's weight slot, identical on every rank when the
  amax reduction covers the FSDP ranks (DelayedScaling(reduce_amax=True), the default, with the default group). A
  shard's quantization records the amax of the whole weight (all-reduced over the FSDP group, `ShardAmaxQuantizer`),
  so the module's FP8 state stays the same on every rank between updates (distributed checkpointing saves it once).
- At the first all-gather of each shard the ranks compare their scales (an all-gather of one float per rank). Shards
  built from different initial weights on different ranks have different current-scaling scales: they are then
  requantized with the largest `scale_inv` (a warning says so), so the gathered weight is exact for every shard.

Uneven sharding (dim 0 not divisible by the number of ranks) sends the padded shard, as FSDP2 requires.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple

import torch

from . import cast as casts
from .constants import DType
from .tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, register_all_gather

__all__ = ["pre_all_gather", "post_all_gather", "ShardAmaxQuantizer"]


def pre_all_gather(shard: Float8Tensor, mesh, orig_size: torch.Size) -> Tuple[Tuple[torch.Tensor], tuple]:
    """(the all-gather input: the shard's FP8 bytes as uint8, padded to FSDP2's shard size), (scale_inv, format)."""
    group = mesh.get_group()
    _bind_amax_reduction(shard, group)
    # once per weight: the flag lives on its quantizer, which FSDP2's re-padding of an uneven shard (a new local
    # tensor on some ranks only) carries over, so every rank makes the same collective calls
    quantizer = shard._quantizer
    if not getattr(quantizer, "_fp8kit_fsdp_scale_checked", False):
        _agree_on_scale(shard, group)
        if quantizer is not None:
            quantizer._fp8kit_fsdp_scale_checked = True
    data = shard._data.contiguous()  # the uint8 bytes
    padded_rows = math.ceil(orig_size[0] / mesh.size()) if len(orig_size) else 0
    padded = (padded_rows, *orig_size[1:])
    if tuple(data.shape) != padded:  # uneven sharding: FSDP2 gathers equal sizes, the padding is dropped afterwards
        buf = torch.zeros(padded, dtype=torch.uint8, device=data.device)
        buf[:data.shape[0]].copy_(data)
        data = buf
    return (data,), (shard.scale_inv.detach().clone(), shard._fp8_dtype)


def post_all_gather(shard: Float8Tensor, outputs: Tuple[torch.Tensor, ...], metadata: tuple, param_dtype: torch.dtype,
                    *, out: Optional[Float8Tensor] = None):
    """The gathered weight as a Float8Tensor over the all-gather output (FSDP2 takes its first rows with
    `as_strided`), or, after the first gather, `out` pointed at the new bytes and scale."""
    (gathered,) = outputs
    scale_inv, fp8_dtype = metadata
    fp8_dtype = DType.cast(fp8_dtype)  # a DType (or a torch float8 dtype)
    data = gathered
    if out is not None:
        out._data = data if data.shape[0] == out.shape[0] else data.narrow(0, 0, out.shape[0])
        out._scale_inv, out._fp8_dtype = scale_inv, fp8_dtype
        out._scale_inv_value = None
        out._transpose, out._transpose_invalid = None, True
        out._values, out._codes_finite = None, False
        return None
    full = Float8Tensor(dtype=param_dtype, data=data, fp8_scale_inv=scale_inv, fp8_dtype=fp8_dtype,
                        quantizer=shard._quantizer)
    return full, (gathered,)


def _bind_amax_reduction(shard: Float8Tensor, group) -> None:
    """From now on the shard's quantizer works with the amax of the whole weight, all-reduced over the FSDP group:
    current scaling scales with it; delayed scaling records it (see ShardAmaxQuantizer)."""
    q = shard._quantizer
    if isinstance(q, Float8CurrentScalingQuantizer):
        if not (q.with_amax_reduction and q.amax_reduction_group is group):
            q = q.copy()
            q.with_amax_reduction, q.amax_reduction_group = True, group
            shard._quantizer = q
    elif isinstance(q, Float8Quantizer) and not (isinstance(q, ShardAmaxQuantizer) and q.group is group):
        shard._quantizer = ShardAmaxQuantizer(q.inner if isinstance(q, ShardAmaxQuantizer) else q, group)


class ShardAmaxQuantizer(Float8Quantizer):
    """The delayed-scaling quantizer of an FSDP2 weight shard: it casts with the scale of `inner` (the weight's
    quantizer, e.g. fp8kit.pytorch.fp8_weights.StateQuantizer, bound to the module state) and records into `inner`'s
    amax the amax of the whole weight, all-reduced (MAX) over the FSDP group. The next amax update max-reduces over
    the ranks anyway, so the scales are unchanged; what changes is that the staging row is the same on every rank,
    so the module's FP8 state is replicated, as distributed checkpointing assumes for a plain tensor."""

    def __init__(self, inner: Float8Quantizer, group):
        self.inner, self.group = inner, group
        super().__init__(inner.scale, inner.amax, inner.dtype, rowwise=inner.rowwise_usage,
                         columnwise=inner.columnwise_usage)

    @property
    def scale(self) -> torch.Tensor:
        return self.inner.scale

    @property
    def amax(self) -> torch.Tensor:
        return self.inner.amax

    def _cast(self, x: torch.Tensor):
        import torch.distributed as dist

        a = torch.nan_to_num(casts.amax(x), nan=0.0)  # NaN is ignored, as in the staging row
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=self.group)
        stage = self.amax
        with torch.no_grad():
            stage.copy_(torch.fmax(stage.reshape(()), a.to(stage.device)).reshape(stage.shape))
        return casts.cast(x, self.scale.reshape(()).to(x.device), self.fp8_torch_dtype)

    def copy(self) -> "ShardAmaxQuantizer":
        return ShardAmaxQuantizer(self.inner.copy(), self.group)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["group"] = None  # a process group is not picklable
        return state


def _agree_on_scale(shard: Float8Tensor, group) -> None:
    """Make every rank's shard use the same scale (see the module docstring); one all-gather of a float."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    mine = shard.scale_inv.detach().reshape(1).to(torch.float32).contiguous()
    invs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(invs, mine, group=group)
    invs = torch.cat(invs)
    if bool((invs == invs[0]).all()):
        return
    warnings.warn(f"fp8kit FSDP2: the shards of an FP8 weight of local shape {tuple(shard.shape)} have different "
                  f"scales on different ranks (scale_inv {invs.tolist()}; different initial weights per rank?); "
                  "they are requantized with the largest scale_inv so that the gathered weight reads them alike",
                  stacklevel=3)
    with torch.no_grad():
        values = shard.dequantize_impl(torch.float32)
        scale = torch.reciprocal(invs.max()).reshape(1)
        Float8Quantizer(scale, torch.zeros(1, device=scale.device), shard._fp8_dtype, columnwise=False) \
            .update_quantized(values, shard)


register_all_gather(pre_all_gather, post_all_gather)  # Float8Tensor's FSDP2 hooks run these
