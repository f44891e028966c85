"""Transformer Engine's FP8 primer, the per-tensor cells, run with fp8kit.

Ported from NVIDIA/TransformerEngine docs/examples/fp8_primer.ipynb (commit 85a919973d062063b86000856b5c0f258a27380d)
and the `cast_to_representable` helper of docs/examples/quickstart_utils.py (commit
f458abe1fdd586c9dfdaa3842bde663d68f8bdaa). Changes, and nothing else:
- imports renamed: `transformer_engine.pytorch` -> `fp8kit.pytorch`, `transformer_engine.common.recipe` ->
  `fp8kit.recipe`;
- CUDA moved to the CPU: `.cuda()` and `device="cuda"` dropped (torch's default device is used);
- sizes shrunk for a CPU: 768 features -> 256, 1024 tokens -> 256;
- the notebook's cells are the body of `main()` (which returns the tensors the cells display), and cells that only
  display a value print it;
- skipped: the MXFP8 and NVFP4 recipes of cell 4 (`MXFP8BlockScaling`, `NVFP4BlockScaling`) and cell 20, which runs
  them: block-scaled formats, which fp8kit (per-tensor FP8 only) does not have.
"""

import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Format


def cast_to_representable(inp, scale=1.0, fp8_format="e4m3"):
    from fp8kit.pytorch.tensor.float8_tensor import Float8Quantizer

    fp8_type = te.DType.kFloat8E4M3 if fp8_format == "e4m3" else te.DType.kFloat8E5M2
    scale = torch.ones(1, dtype=torch.float32) * scale
    amax_history = torch.zeros(1, 1, dtype=torch.float32)
    quantizer = Float8Quantizer(scale=scale, amax=amax_history, fp8_dtype=fp8_type)
    ret = quantizer(inp)
    ret = ret.dequantize()
    return ret


def main():
    # ---- cell 4 (the per-tensor recipe) ----
    fp8_format = Format.HYBRID  # E4M3 during forward pass, E5M2 during backward pass
    fp8_recipe = DelayedScaling(fp8_format=fp8_format, amax_history_len=16, amax_compute_algo="max")

    # ---- cell 7 ----
    torch.manual_seed(12345)

    my_linear = te.Linear(256, 256, bias=True)

    inp = torch.rand((256, 256))

    with te.autocast(enabled=True, recipe=fp8_recipe):
        out_fp8 = my_linear(inp)

    # ---- cell 10 ----
    loss_fp8 = out_fp8.mean()

    loss_fp8.backward()  # This backward pass uses FP8, since out_fp8 was calculated inside autocast

    out_fp32 = my_linear(inp)
    loss_fp32 = out_fp32.mean()
    loss_fp32.backward()  # This backward pass does not use FP8, since out_fp32 was calculated outside autocast

    # ---- cells 12 and 13 ----
    print(out_fp8)
    print(out_fp32)

    # ---- cell 15 ----
    inp_representable = cast_to_representable(inp)
    my_linear.weight.data = cast_to_representable(my_linear.weight.data)

    out_fp32_representable = my_linear(inp_representable)

    print(out_fp32_representable)

    # ---- cell 17 ----
    print(out_fp8 - out_fp32_representable)

    return {"out_fp8": out_fp8, "out_fp32": out_fp32, "out_fp32_representable": out_fp32_representable}


if __name__ == "__main__":
    main()
