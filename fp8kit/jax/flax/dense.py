"""`DenseGeneral`: a Flax dense layer whose GEMMs run in FP8 inside an enabled `fp8kit.jax.autocast`."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from .base import (
    Initializer,
    compute_dtype,
    flat_bias_init,
    flat_kernel_init,
    fp8_dense,
    low_rank_adaptation,
    normalize_axes,
    tuple_of,
    with_axes,
)

__all__ = ["DenseGeneral", "Dense"]


def check_checkpoint_name(name: Optional[str]) -> None:
    """`quantization_checkpoint_name` names quantized tensors for remat policies; fp8kit keeps them as residuals of
    its custom_vjp, so there is nothing to name."""
    if name is not None:
        raise NotImplementedError("quantization_checkpoint_name is not supported: fp8kit keeps the FP8 operands as "
                                  "residuals of its GEMM; leave it None")


class DenseGeneral(nn.Module):
    """`y = x . kernel + bias` over the input `axis`, in FP8 inside an enabled `autocast` (Transformer Engine's
    DenseGeneral, also a drop-in for flax's `nn.Dense` / `nn.DenseGeneral`).

    Parameters: "kernel" `[*x.shape[axis], *features]`, "bias" `[*features]` (flax's names and layout), and with
    `enable_low_rank_adaptation` "lora_a_kernel" / "lora_b_kernel". Delayed-scaling state: "fp8_metas" variables
    x_scale, x_amax_history, kernel_*, grad_* (see docs/jax.md).

    dtype: the computation dtype, as in flax (None: the input's); the output has it. param_dtype: the parameters'
    dtype. precision: `lax.dot_general` precision of the high-precision GEMM (outside autocast).
    kernel_axes / bias_axes: logical axis names for `nn.with_logical_partitioning` (empty: no annotation); an
    initializer already wrapped in `nn.with_logical_partitioning` works too. input_axes: logical axes to constrain
    the input's sharding to. transpose_batch_sequence: accepted, no effect (rows are independent).
    """

    features: Union[int, Sequence[int]]
    kernel_init: Optional[Initializer] = None
    kernel_axes: Tuple[Optional[str], ...] = ()
    use_bias: bool = True
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[Optional[str], ...] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[int, Sequence[int]] = -1
    dtype: Any = None
    input_axes: Tuple[Optional[str], ...] = ()
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """inputs `[...]` -> `[*other axes, *features]` in the computation dtype."""
        check_checkpoint_name(self.quantization_checkpoint_name)
        features = tuple_of(self.features)
        axis = normalize_axes(tuple_of(self.axis), inputs.ndim)
        in_shape = tuple(inputs.shape[a] for a in axis)
        kernel_shape = in_shape + features
        if self.kernel_axes and len(self.kernel_axes) != len(kernel_shape):
            raise ValueError(f"kernel_axes {self.kernel_axes} do not match the kernel shape {kernel_shape}")
        kernel_init = flat_kernel_init(self.kernel_init, len(axis))
        kernel = self.param("kernel", with_axes(kernel_init, self.kernel_axes), kernel_shape, self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", with_axes(flat_bias_init(self.bias_init), self.bias_axes), features,
                              self.param_dtype)
        dtype = compute_dtype(self.dtype, inputs)
        x = inputs.astype(dtype)
        y = fp8_dense(self, x, kernel, bias, dtype, (axis, tuple(range(len(axis)))), self.input_axes,
                      self.kernel_axes or None)
        if self.enable_low_rank_adaptation:
            moved = jnp.moveaxis(x, axis, tuple(range(x.ndim - len(axis), x.ndim)))
            y = y + low_rank_adaptation(self, moved, in_shape, features, self.low_rank_adaptation_dim,
                                        self.low_rank_adaptation_alpha, self.kernel_init, param_dtype=self.param_dtype)
        return y.astype(dtype)


class Dense(DenseGeneral):
    """`DenseGeneral` under flax's name `Dense`, for swapping `flax.linen.Dense` without renaming anything: flax
    names unnamed submodules after their class ("Dense_0"), and parameter paths and initial values follow those
    names. Same fields as DenseGeneral (`features` an int, `axis=-1` for flax's Dense)."""
