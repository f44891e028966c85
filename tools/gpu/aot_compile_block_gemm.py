"""Ahead-of-time compile of the block GEMM kernel (fp8kit/pytorch/kernels/triton_block_gemm.py) for CUDA targets,
on a machine without a GPU: Triton's front end, its CUDA passes and the ptxas it bundles, for every constexpr
combination the host side (`kernels.block_gemm_ops`) launches on that target: MODE 0/1/2 with F64 at BLOCK 32
(MXFP8) and 128 (Float8 block), with DOT64 as `dot64_for_capability` says (the float64 MMA on sm_90, the rank-1
updates elsewhere), and MODE 3 without F64 at BLOCK 16 (NVFP4); the host's tiles, warps and stages.

    python tools/gpu/aot_compile_block_gemm.py                        # sm_90 and sm_100, this checkout's kernel
    python tools/gpu/aot_compile_block_gemm.py --other-branch         # also the F64 branch the host does not use
    python tools/gpu/aot_compile_block_gemm.py --source old_triton_block_gemm.py   # a kernel without DOT64

Prints one line per (target, combination): `ok` with the PTX's MMA and FMA instructions, or `FAIL` with the error
(`block_gemm_ops.describe_error`); the other branch's lines say `(not used)` and do not count. Exits 1 when a
combination the host uses failed. Why it exists: on an H200 (Triton 3.6.0) the F64 branch's float64 `tl.dot`
failed to compile ("CompilationError at 24:20", a bare assert on the accumulator's dtype), which the interpreter
tests on a CPU cannot see. Needs only Triton with its CUDA backend (no GPU, no CUDA install). Run it under the
Triton the GPU has: front ends differ (that kernel compiles under Triton 3.9.0 and fails under 3.6.0), e.g.
`pip install --no-deps --target /tmp/triton36 triton==3.6.0` and `PYTHONPATH=/tmp/triton36:.`.
"""
import argparse
import importlib.util
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fp8kit.pytorch.kernels import block_gemm_ops as ops  # noqa: E402

KERNEL = os.path.join(os.path.dirname(__file__), "..", "..", "fp8kit", "pytorch", "kernels", "triton_block_gemm.py")


def host_combinations(arch: int, other_branch: bool = False):
    """(constexprs, options, used by the host) of each launch the host side makes on compute capability `arch`
    (90, 100, ...), and with `other_branch` the F64 launches with the other DOT64."""
    dot64 = ops.dot64_for_capability(divmod(arch, 10))
    combos = []
    for block, mode in [(32, m) for m in (0, 1, 2)] + [(128, m) for m in (0, 1, 2)] + [(16, ops.PRESCALED)]:
        f64 = mode != ops.PRESCALED
        bm, bn, warps, stages = ops._TILES[f64]
        for d, used in [(dot64 and f64, True)] + ([(not dot64, False)] if f64 and other_branch else []):
            cx = dict(BLOCK=block, KC=min(block, 32), BM=bm, BN=bn, MODE=mode, F64=f64, DOT64=d)
            combos.append((cx, dict(num_warps=warps, num_stages=stages), used))
    return combos


def load_kernel(path: str):
    spec = importlib.util.spec_from_file_location("_aot_triton_block_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.block_gemm_kernel


def compile_one(fn, arch: int, cx: dict, options: dict):
    """The compiled kernel (its `.asm["ptx"]`, `.metadata`) for CUDA compute capability `arch`; raises Triton's
    error when the kernel does not compile. Constexprs the kernel does not have (DOT64 for an old one) are left out."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cx = {a: v for a, v in cx.items() if a in fn.arg_names}
    sig = {a: "constexpr" if a in cx else "*fp32" if a.endswith("_ptr") else "i32" for a in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", arch, 32), options=options)


def ptx_facts(ptx: str) -> str:
    found = re.findall(r"\b((?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)[\w.]*|fma\.rn\.f64|fma\.rn\.f32(?:x2)?|"
                       r"cvt\.rn\.f32\.f64)\b", ptx)
    return ", ".join(sorted(set(found))) or "no MMA or FMA instruction"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90, 100], help="CUDA compute capabilities (90 100)")
    p.add_argument("--source", default=KERNEL, help="the kernel file (default: this checkout's)")
    p.add_argument("--other-branch", action="store_true", help="also the F64 branch the host does not use there")
    args = p.parse_args(argv)
    import triton

    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="fp8kit_aot_"))
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    fn = load_kernel(args.source)
    print(f"Triton {triton.__version__}; kernel {os.path.abspath(args.source)}")
    failed = 0
    for arch in args.arch:
        for cx, options, used in host_combinations(arch, args.other_branch):
            dot64 = int(cx["DOT64"]) if "DOT64" in fn.arg_names else "-"
            what = (f"sm_{arch} BLOCK={cx['BLOCK']:<3} MODE={cx['MODE']} F64={int(cx['F64'])} DOT64={dot64}"
                    + ("" if used else " (not used)"))
            try:
                k = compile_one(fn, arch, cx, options)
            except Exception as e:  # noqa: BLE001 - reported, counted
                failed += used
                print(f"FAIL {what}: {ops.describe_error(e)}")
                continue
            print(f"ok   {what}: shared {k.metadata.shared} B; {ptx_facts(k.asm['ptx'])}")
    print(f"{failed} failed" if failed else "all the host's combinations compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
