"""Ahead-of-time compile of the block GEMM kernel (fp8kit/pytorch/kernels/triton_block_gemm.py) for CUDA targets,
on a machine without a GPU: Triton's front end, its CUDA passes and the ptxas it bundles, for every constexpr
combination the host side (`kernels.block_gemm_ops`) launches: MODE 0/1/2 with F64 at BLOCK 32 (MXFP8) and 128
(Float8 block), MODE 3 without F64 at BLOCK 16 (NVFP4), with the host's tiles, warps and stages.

    python tools/gpu/aot_compile_block_gemm.py                    # sm_90 and sm_100, this checkout's kernel
    python tools/gpu/aot_compile_block_gemm.py --arch 90 --source old_triton_block_gemm.py --kc-f64 32

Prints one line per (arch, combination): `ok` with the PTX's float64 instructions, or `FAIL` with the error's last
line; exits 1 when any failed. Why it exists: on an H200 (Triton 3.6.0) the F64 branch's float64 `tl.dot` failed to
compile ("CompilationError at 24:20"), which the interpreter tests on a CPU cannot see.
"""
import argparse
import importlib.util
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

KERNEL = os.path.join(os.path.dirname(__file__), "..", "..", "fp8kit", "pytorch", "kernels", "triton_block_gemm.py")


def host_combinations(kc_f64=None):
    """(constexprs, options) of each launch the host side makes: its tiles and KC as block_gemm_ops chooses them
    (`kc_f64`: another KC for the F64 launches, 32 for the code before the rank-1 updates)."""
    from fp8kit.pytorch.kernels import block_gemm_ops as ops

    combos = []
    for block, mode in [(32, m) for m in (0, 1, 2)] + [(128, m) for m in (0, 1, 2)] + [(16, ops.PRESCALED)]:
        f64 = mode != ops.PRESCALED
        bm, bn, warps, stages = ops._TILES[f64]
        cx = dict(BLOCK=block, KC=min(block, kc_f64) if f64 and kc_f64 else ops.kc_for(block, f64), BM=bm, BN=bn, MODE=mode, F64=f64)
        combos.append((cx, dict(num_warps=warps, num_stages=stages)))
    return combos


def load_kernel(path: str):
    spec = importlib.util.spec_from_file_location("_aot_triton_block_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.block_gemm_kernel


def compile_one(fn, arch: int, cx: dict, options: dict):
    """The compiled kernel (its `.asm["ptx"]`, `.metadata`) for CUDA compute capability `arch`; raises Triton's
    error when the kernel does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: "constexpr" if a in cx else "*fp32" if a.endswith("_ptr") else "i32" for a in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", arch, 32), options=options)


def ptx_facts(ptx: str) -> str:
    ops = sorted(set(re.findall(r"\b((?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)[\w.]*|fma\.rn\.f64|fma\.rn\.f32(?:x2)?|"
                                r"cvt\.rn\.f32\.f64|mul\.f64)\b", ptx)))
    return ", ".join(ops) or "no float64 / MMA instruction"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90, 100], help="CUDA compute capabilities (90 100)")
    p.add_argument("--source", default=KERNEL, help="the kernel file (default: this checkout's)")
    p.add_argument("--kc-f64", type=int, help="KC of the F64 launches (default: the host's; 32 for the old kernel)")
    args = p.parse_args(argv)
    import triton

    from fp8kit.pytorch.kernels import block_gemm_ops as ops

    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="fp8kit_aot_"))
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    fn = load_kernel(args.source)
    print(f"Triton {triton.__version__}; kernel {os.path.relpath(args.source)}")
    failed = 0
    for arch in args.arch:
        for cx, options in host_combinations(args.kc_f64):
            what = f"sm_{arch} BLOCK={cx['BLOCK']:<3} MODE={cx['MODE']} F64={int(cx['F64'])} KC={cx['KC']}"
            try:
                k = compile_one(fn, arch, cx, options)
            except Exception as e:  # noqa: BLE001 - reported, counted
                failed += 1
                print(f"FAIL {what}: {ops.describe_error(e)}")
                continue
            print(f"ok   {what}: shared {k.metadata.shared} B; "
                  f"{ptx_facts(k.asm['ptx'])}")
    print(f"{failed} failed" if failed else "all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
