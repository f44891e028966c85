"""Times variants of the block GEMM kernel's F64 branch (fp8kit/pytorch/kernels/triton_block_gemm.py) on one
GEMM and checks that every variant gives the torch path's bits (the block sums are exact, so any order must agree).

    python tools/gpu/bench_block_gemm.py --shape 4096 4096 4096 --out /tmp/out/bench_block_gemm.json
    python tools/gpu/bench_block_gemm.py --device cpu --shape 64 64 256   # interpreter dry run (TRITON_INTERPRET=1)

Variants: the float64 MMA (`tl.dot`, DOT64: the host's choice on sm_90) and the float64 rank-1 updates (the host's
choice elsewhere) with tiles and unrolling varied, also with float64 operands (no float32 -> float64 conversion in
the kernel). Not run on a GPU yet as a script: the numbers below came from the same launches patched into the
kernel on an H200.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from fp8kit.pytorch import block_gemm as bg  # noqa: E402
from fp8kit.pytorch import kernels  # noqa: E402
from fp8kit.pytorch.kernels import block_gemm_ops as ops  # noqa: E402
from fp8kit.pytorch.kernels.launch import cdiv  # noqa: E402

# name: (BM, BN, warps, stages, KC, DOT64, float64 operands). Measured on an H200 (Triton 3.6, 4096^3, MXFP8 /
# Float8 block 2-D): dot64 64x64 3.48 / 3.04 ms; rank1 64x64 kc32 75.7 / 756 ms; rank1 kc8 927 / 974 ms.
VARIANTS = {
    "dot64 64x64 w4 kc32 (host, sm_90)": (64, 64, 4, 2, 32, True, False),
    "dot64 128x128 w8 kc32": (128, 128, 8, 2, 32, True, False),
    "rank1 64x64 w4 kc32 (host, elsewhere)": (64, 64, 4, 2, 32, False, False),
    "rank1 64x64 w4 kc32 f64-in": (64, 64, 4, 2, 32, False, True),
    "rank1 128x64 w4 kc32": (128, 64, 4, 2, 32, False, False),
    "rank1 64x64 w4 kc8": (64, 64, 4, 2, 8, False, False),
}


def operands(m, n, k, block, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 30).to(torch.float8_e4m3fn).float()
    b = (torch.randn(n, k, generator=g) * 30).to(torch.float8_e4m3fn).float()
    nb = cdiv(k, block)
    sa = torch.exp2(torch.randint(-8, 8, (m, nb), generator=g).float())
    sb = torch.exp2(torch.randint(-8, 8, (n, nb), generator=g).float())
    return [t.to(device) for t in (a, b, sa, sb)]


def run_variant(fn, a, b, sa, sb, block, mode, v, interpret):
    bm, bn, warps, stages, kc, dot64, f64_in = v
    if f64_in:
        a, b = a.double(), b.double()
    m, k = a.shape
    n = b.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=a.device)
    kc = min(kc, block)
    extra = {} if interpret else dict(num_warps=warps, num_stages=stages)
    fn[(cdiv(m, bm), cdiv(n, bn))](a, b, sa, sb, y, m, n, k, cdiv(k, block), a.stride(0), a.stride(1), b.stride(0),
                                   b.stride(1), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), BLOCK=block,
                                   KC=kc, BM=bm, BN=bn, MODE=mode, F64=True, DOT64=dot64, **extra)
    return y


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", type=int, nargs=3, default=[4096, 4096, 4096], metavar=("M", "N", "K"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", nargs="*", help="variant names (substrings)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    interpret = args.device == "cpu"
    fn = kernels.kernel_module(interpret, "triton_block_gemm").block_gemm_kernel
    m, n, k = args.shape
    results = {"shape": [m, n, k], "device": torch.cuda.get_device_name() if not interpret else "cpu", "cases": []}
    for block, mode, name in ((32, ops.A_FIRST, "mxfp8"), (128, ops.BOTH_2D, "float8 block 2d x 2d")):
        a, b, sa, sb = operands(m, n, k, block, args.device)
        A, B = bg.BlockOperand(a, sa, block, True, True), bg.BlockOperand(b, sb, block, mode != ops.BOTH_2D, True)
        if mode == ops.BOTH_2D:
            A = A._replace(one_d=False)
        want = bg._accumulate(A, B, bg.accumulate_mode(A, B, host_read=False))
        for vname, v in VARIANTS.items():
            if args.only and not any(s in vname for s in args.only):
                continue
            if v[5] and not interpret and torch.cuda.get_device_capability()[0] != 9:
                continue
            row = {"gemm": name, "variant": vname}
            try:
                t0 = time.perf_counter()
                y = run_variant(fn, a, b, sa, sb, block, mode, v, interpret)
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
                row["bit_equal_torch_path"] = bool(torch.equal(y.view(torch.int32), want.view(torch.int32)))
                if not interpret:
                    times = []
                    for _ in range(args.reps):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        run_variant(fn, a, b, sa, sb, block, mode, v, interpret)
                        e1.record()
                        torch.cuda.synchronize()
                        times.append(e0.elapsed_time(e1))
                    row["ms"] = round(min(times), 3)
                    row["tflops"] = round(2 * m * n * k / (row["ms"] * 1e-3) / 1e12, 2)
            except Exception as e:  # noqa: BLE001 - reported per variant
                row["error"] = ops.describe_error(e)
            print(json.dumps(row), flush=True)
            results["cases"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
