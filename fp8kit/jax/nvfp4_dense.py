"""The dense GEMMs under NVFP4BlockScaling as a `jax.custom_vjp` (the layout of fp8kit/jax/block_dense.py):

    GEMM    computes            A (contraction last)            B (contraction last)
    fprop   y  = x @ K          x, rowwise (1x16 along K)       W = K.T, rowwise (the weight's blocks)
    dgrad   dx = dy @ K.T       dy, rowwise (along out)         W.T = K, the weight's columnwise usage
    wgrad   dK = x.T @ dy       x.T, columnwise (RHT)           dy.T, columnwise (RHT)

Each role's QParams as fp8kit.pytorch's NVFP4 quantizers read them (`fp4_quant_fwd_inp`, `fp4_quant_fwd_weight`,
`fp4_quant_bwd_grad`): by default the input's and the gradient's columnwise usages are transformed (the transform
cancels in wgrad), the weight has 16x16 blocks, and the gradient is rounded stochastically. Stochastic rounding
draws from a JAX PRNG key given to the call (`fold_in(fold_in(key, role), usage)`, role 0 x, 1 kernel, 2 grad;
usage 0 rowwise, 1 columnwise): a given key gives the same bytes on every run, but not the draws of torch's generator or
Transformer Engine's Philox stream. `backward_override` as in block_dense.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from .cast import F32
from .gemm import hp_gemm
from .nvfp4_gemm import NVFP4Spec, dequantize_nvfp4, nvfp4_gemm, nvfp4_operand

__all__ = ["NVFP4DenseConfig", "nvfp4_config", "nvfp4_dense", "needs_sr_key"]

_DGRAD = ((1,), (1,))  # dy[M, N] . K[K, N] over N
_WGRAD = ((0,), (0,))  # x[M, K] . dy[M, N] over M


@dataclasses.dataclass(frozen=True)
class NVFP4DenseConfig:
    """Static description of one NVFP4 dense call: the specs of x, kernel and grad, the backward override, and the
    dtypes of the results."""

    x: NVFP4Spec
    kernel: NVFP4Spec
    grad: NVFP4Spec
    backward_override: Optional[str]
    x_dtype: Any
    kernel_dtype: Any
    bias_dtype: Any  # None without bias
    axis_names: Tuple[str, ...] = ()  # inside shard_map: the mesh axes the per-tensor amaxes are all-reduced over

    @property
    def needs_key(self) -> bool:
        """A role that is cast rounds stochastically (the gradient is not cast under a backward override)."""
        roles = (self.x, self.kernel) + ((self.grad,) if self.backward_override is None else ())
        return any(s.stochastic_rounding for s in roles)


def _spec(q) -> NVFP4Spec:
    return NVFP4Spec(bool(q.random_hadamard_transform), bool(q.fp4_2d_quantization), bool(q.stochastic_rounding))


def _config(recipe: Any, x_dtype=None, kernel_dtype=None, bias_dtype=None, axis_names=()) -> NVFP4DenseConfig:
    specs = (_spec(q) for q in (recipe.fp4_quant_fwd_inp, recipe.fp4_quant_fwd_weight, recipe.fp4_quant_bwd_grad))
    return NVFP4DenseConfig(*specs, recipe.backward_override, x_dtype, kernel_dtype, bias_dtype, tuple(axis_names))


def nvfp4_config(recipe: Any, x_dtype, kernel_dtype, bias_dtype, axis_names: Tuple[str, ...] = ()
                 ) -> NVFP4DenseConfig:
    """The config of an NVFP4BlockScaling recipe; its unimplemented options are refused, naming them.
    `axis_names`: inside `shard_map`, the mesh axes to all-reduce the per-tensor amaxes over (dense.amax_axes)."""
    recipe.check_implemented()
    return _config(recipe, jnp.dtype(x_dtype), jnp.dtype(kernel_dtype),
                   None if bias_dtype is None else jnp.dtype(bias_dtype), axis_names)


def needs_sr_key(recipe: Any) -> bool:
    """Whether dense under the NVFP4BlockScaling `recipe` needs a stochastic-rounding PRNG key."""
    return _config(recipe).needs_key


def _operand(cfg: NVFP4DenseConfig, t, role: int, columnwise: bool, key):
    """One role's usage (role 0: x, 1: kernel, 2: grad) of `t`, with its spec, SR key and the config's amax axes.
    x and grad are (rows, features): their columnwise usage is the transpose; the kernel K (in, out) holds W = K.T:
    its rowwise usage is the transpose."""
    spec = (cfg.x, cfg.kernel, cfg.grad)[role]
    return nvfp4_operand(t, spec, transpose=columnwise != (role == 1), key=_key(key, role, columnwise),
                         axis_names=cfg.axis_names)


def _key(key, role: int, columnwise: bool):
    """The stochastic-rounding key of one role's usage (role 0: x, 1: kernel, 2: grad): fold_in(fold_in(key, role),
    columnwise)."""
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, role), int(columnwise))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nvfp4_dense(cfg: NVFP4DenseConfig, x, kernel, bias, key):
    return _nvfp4_dense_fwd(cfg, x, kernel, bias, key)[0]


def _nvfp4_dense_fwd(cfg: NVFP4DenseConfig, x, kernel, bias, key):
    qx = _operand(cfg, x, 0, False, key)
    qw = _operand(cfg, kernel, 1, False, key)  # W = K.T (N, K), blocks along K
    y = nvfp4_gemm(qx, qw)
    if bias is not None:
        y = y + bias.astype(F32)
    override = cfg.backward_override
    if override is None:  # the columnwise usages the backward GEMMs read
        saved = (_operand(cfg, x, 0, True, key), _operand(cfg, kernel, 1, True, key))
    elif override == "dequantized":
        saved = (dequantize_nvfp4(qx), dequantize_nvfp4(qw).T)
    else:
        saved = (x, kernel)
    return y.astype(cfg.x_dtype), (saved, key)


def _nvfp4_dense_bwd(cfg: NVFP4DenseConfig, res, dy):
    saved, key = res
    if cfg.backward_override is not None:
        x_op, k_op = saved
        dx, dk = hp_gemm(dy, k_op, _DGRAD), hp_gemm(x_op, dy, _WGRAD)
    else:
        qx_t, qk = saved  # x.T (K, M) blocks along M; K (K, N) blocks along N
        dx = nvfp4_gemm(_operand(cfg, dy, 2, False, key), qk)
        dk = nvfp4_gemm(qx_t, _operand(cfg, dy, 2, True, key))
    dbias = None if cfg.bias_dtype is None else jnp.sum(dy.astype(F32), axis=0).astype(cfg.bias_dtype)
    return dx.astype(cfg.x_dtype), dk.astype(cfg.kernel_dtype), dbias, None


_nvfp4_dense.defvjp(_nvfp4_dense_fwd, _nvfp4_dense_bwd)
_nvfp4_dense_jit = jax.jit(_nvfp4_dense, static_argnums=0)


def nvfp4_dense(cfg: NVFP4DenseConfig, x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array],
                key: Optional[jax.Array] = None) -> jax.Array:
    """`x[M, K] @ kernel[K, N] (+ bias[N])` in x's dtype with NVFP4 GEMMs and their custom backward. `key`: the
    PRNG key of stochastic rounding, required when a role rounds stochastically."""
    (m, k), n = x.shape, kernel.shape[1]
    if m % 32 or k % 32 or n % 32:
        raise ValueError(f"dense: NVFP4 needs the flattened batch ({m}), input ({k}) and output ({n}) dims to be "
                         "multiples of 32 (each is the contraction dim of one GEMM, which Transformer Engine's NVFP4 "
                         "GEMM requires)")
    if cfg.needs_key and key is None:
        raise ValueError("dense: NVFP4BlockScaling rounds the gradient stochastically and needs a PRNG key: pass "
                         "quantizer_set={'sr_rng': jax.random.key(seed)} (a fresh key per step), or "
                         "NVFP4BlockScaling(disable_stochastic_rounding=True)")
    return _nvfp4_dense_jit(cfg, x, kernel, bias, key if cfg.needs_key else None)
