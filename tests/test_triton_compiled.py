"""The CUDA variant of every kernel, compiled offline for sm_89 and sm_90 (Triton's bundled ptxas; no GPU needed),
read as PTX and TTGIR:

- exact arithmetic: the FP8 convert is the round-to-nearest-even saturating one, divisions are IEEE (`div.rn`),
  nothing flushes subnormals (no `.ftz`), no approximate division, the cast's multiply is not fused into an FMA;
- no divergent barriers (issue 16, P0): the cast and amax kernels contain no branch at all (`bra`), so every warp of
  a CTA executes every `bar.sync` Triton inserts for the transpose and the reductions, and each program does
  exactly one atomic (an int32 max: `red`/`atom` `.max.s32`), no compare-and-swap and no volatile read.
"""

import re

import pytest

triton = pytest.importorskip("triton")

from fp8kit.pytorch import kernels  # noqa: E402

_CAST = dict(FP8_MAX=448.0, E4M3=True, AMAX=True, SCALE_FROM_AMAX=False, POW2=False, WRITE_SCALE=False,
             WRITE_SCALE_INV=True)
_CHUNK = 32
_JOBS = {
    # name: (kernel, x type, constexprs, instructions that must appear, branch-free)
    "cast_transpose_dbias_e4m3": ("cast_transpose_kernel", "bf16", dict(
        _CAST, TRANSPOSE=True, DBIAS=True, BLOCK_M=64, BLOCK_N=64),
        ["cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "mul.f32"], True),
    "cast_transpose_current_e5m2": ("cast_transpose_kernel", "fp16", dict(
        _CAST, FP8_MAX=57344.0, E4M3=False, AMAX=False, SCALE_FROM_AMAX=True, POW2=True, WRITE_SCALE=True,
        TRANSPOSE=True, DBIAS=False, BLOCK_M=64, BLOCK_N=64), ["cvt.rn.satfinite.e5m2x2.f32", "div.rn.f32"], True),
    "cast_flat_delayed_e4m3": ("cast_flat_kernel", "fp32", dict(_CAST, BLOCK=4096),
                               ["cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "mul.f32"], True),
    "cast_flat_current_e4m3": ("cast_flat_kernel", "bf16", dict(_CAST, AMAX=False, SCALE_FROM_AMAX=True, BLOCK=4096),
                               ["cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32"], True),
    "amax": ("amax_kernel", "bf16", dict(BLOCK=4096), [], True),
    "column_sum": ("column_sum_kernel", "fp32", dict(BLOCK_T=16, BLOCK_N=128), ["add.f32"], False),
    "update": ("update_kernel", None, dict(HAS_MASK=True, MOST_RECENT=False, POW2=True, BLOCK_N=32, BLOCK_L=32),
               ["bar.sync", "div.rn.f32"], False),
    "update_states": ("update_states_kernel", None, dict(MOST_RECENT=False, POW2=False, CHUNK=_CHUNK, BLOCK_N=4,
                                                         BLOCK_L=256), ["bar.sync", "div.rn.f32"], False),
}
_ARG_TYPES = {"q_ptr": "*u8", "qt_ptr": "*u8", "amax_bits_ptr": "*i32", "out_bits_ptr": "*i32",
              "recompute_ptr": "*i8", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "L": "i32", "T": "i32",
              "tiles_n": "i32", "numel": "i64", "scaled_max": "fp32", "eps": "fp32",
              "histories": ("i64",) * _CHUNK, "scales": ("i64",) * _CHUNK, "widths": ("i32",) * _CHUNK,
              "flags": ("i32",) * _CHUNK}


def _compile(job, arch, monkeypatch, tmp_path):
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 3):
        pytest.skip("ASTSource signature API of Triton >= 3.3")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the default the kernels run with; silences a warning
    name, x_type, constexprs, _, _ = _JOBS[job]
    fn = getattr(kernels.kernel_module(False), name)
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("x_ptr", "p_ptr"):
            signature[arg] = "*" + x_type
        else:
            signature[arg] = _ARG_TYPES.get(arg, "*fp32")
    try:
        return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))
    except (FileNotFoundError, PermissionError) as e:  # no usable ptxas in this install
        pytest.skip(f"cannot compile for CUDA here: {e}")


def _instructions(ptx: str):
    """PTX instruction lines without comments, `.loc` directives and debug sections."""
    code = ptx.split(".section")[0]
    lines = (line.split("//")[0].strip() for line in code.splitlines())
    return [line for line in lines if line and not line.startswith(".")]


@pytest.mark.parametrize("arch", [89, 90])
@pytest.mark.parametrize("job", sorted(_JOBS))
def test_compiled_kernels(job, arch, monkeypatch, tmp_path):
    compiled = _compile(job, arch, monkeypatch, tmp_path)
    _, _, _, needed, branch_free = _JOBS[job]
    ptx = compiled.asm["ptx"]
    for instruction in needed:
        assert instruction in ptx, instruction
    for banned in (".ftz", "div.approx", "div.full", "rcp.approx", "cvt.rz.satfinite"):
        assert banned not in ptx, banned
    if "cvt.rn.satfinite" in "".join(needed):
        assert "fma.rn.f32" not in ptx
    code = _instructions(ptx)
    atomics = [line for line in code if re.search(r"\b(atom|red)\.global", line)]
    assert not any(".cas" in line or ".exch" in line for line in atomics), atomics
    assert not any("ld.volatile" in line for line in code)
    if branch_free:
        assert not [line for line in code if re.search(r"\bbra\b", line)], "data-dependent branch in the kernel"
        ttgir = compiled.asm["ttgir"]
        for construct in ("scf.if", "scf.while", "cf.cond_br"):
            assert construct not in ttgir, construct
        amax = _JOBS[job][2].get("AMAX", job == "amax")
        assert len(atomics) == (1 if amax else 0), atomics
        assert ttgir.count("tt.atomic_rmw") == (1 if amax else 0)
        if amax:
            assert ".max.s32" in atomics[0] and atomics[0].startswith("@"), atomics[0]  # one thread, predicated
    else:
        assert not atomics
