"""The GEMM path a GPU runs, on CPU tensors: per-tensor FP8 GEMMs through `gemm.scaled_mm` (torch's CPU
`_scaled_mm`, as `torch._scaled_mm` on a GPU; E5M2 x E5M2 widened, as there) and casts that write the transposes
the GPU's GEMMs read. Shared by tests/test_compile.py and tools/gpu/sim_accelerator_compile.py."""

import contextlib

import torch

from fp8kit.pytorch import gemm
from fp8kit.pytorch.tensor.storage import Float8TensorStorage


def accelerator_rule(a, b, out_dtype, bias=None, use_fast_accum=False):
    if a.fp8_dtype == b.fp8_dtype == torch.float8_e5m2:
        return gemm.widened_gemm(a, b, out_dtype, bias)
    return gemm.scaled_mm(a, b, out_dtype, bias, use_fast_accum)


def _with_transpose(self):
    if self._transpose is None or self._transpose_invalid:
        self._create_transpose()
    return self


@contextlib.contextmanager
def accelerator_gemm_path():
    """In this scope, per-tensor FP8 storages on CPU take the accelerator's GEMM rule and transposes."""
    before = Float8TensorStorage.with_transpose
    Float8TensorStorage.with_transpose = _with_transpose
    gemm.register_gemm_rule(Float8TensorStorage, accelerator_rule)
    try:
        yield
    finally:
        gemm.register_gemm_rule(Float8TensorStorage, gemm.per_tensor_gemm)
        Float8TensorStorage.with_transpose = before
