"""Quantize a tensor with both FP8 formats and show the error."""

import torch

import fp8kit.pytorch as te

torch.manual_seed(0)
x = torch.randn(4096) * 3
for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    q = te.quantize(x, fp8_dtype)
    err = (q.dequantize() - x).norm() / x.norm()
    print(f"{str(fp8_dtype):22s} scale={1 / q.scale_inv.item():10.4f} relative error={err:.4%}")
