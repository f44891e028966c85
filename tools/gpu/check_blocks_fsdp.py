"""GPU checks of fp8kit's block recipes (MXFP8, Float8 block scaling, NVFP4) and of FSDP2 with FP8 weights.

A. Block recipes, CUDA against the CPU:
   quant_mxfp8 / quant_float8block / quant_nvfp4: the same bf16 / float32 / float16 inputs (random, every bf16 bit
     pattern shuffled, full exponent range, special blocks with zeros / NaN / inf / max / subnormals, non-multiple
     and 3-D shapes) quantized by the recipe's quantizer (both usages) on the CPU and on the device; every data and
     scale field (and NVFP4's amaxes) compared BIT FOR BIT (uint8 / int32 views). A shape the CPU refuses must be
     refused on the device too (same exception type).
   linear_blocks: one te.Linear forward + backward per block recipe on the device and on the CPU (same weights, input,
     output gradient): y, dx, dW, db bitwise equality flag, max relative error (max|a-b| / max|b|) against the CPU
     result and against float64 (unquantized) math; the quantized input and weight the layer saves for backward
     (saved_tensors_hooks) and the quantized_model_init weight compared bit for bit; which GEMM path ran (aten ops
     counted with a TorchDispatchMode: _scaled_mm = native FP8 GEMM, otherwise fp8kit's emulation).
B. FSDP2 (fully_shard) with FP8 weights (quantized_model_init), world size 1, in-process (nccl on CUDA, gloo on CPU):
   fsdp_current / fsdp_delayed: a 3-Linear MLP trained a few steps with FusedAdam (master weights) with and without
     fully_shard: losses, final FP8 weight bytes + scale_inv, biases and optimizer masters compared bit for bit; the
     all-gather sends uint8 (FP8 bytes) of the expected size (wrapped torch.distributed all-gather functions); the
     weight the forward receives is a Float8Tensor whose uint8 bytes equal the shard's; under delayed scaling the
     modules' amax histories and scales too, each model's read right after its own training (an idle model
     registered under the same key still takes part in the key's updates: see docs/distributed.md, FSDP2).

Usage: python3 tools/gpu/check_blocks_fsdp.py --device cuda --out result.json [--budget 90]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from fsdp_checks import check_fsdp_current, check_fsdp_delayed
from gpu_check_common import _fields, _sync, _tb, bits_equal, compare_fields, rel  # sets sys.path

import fp8kit.pytorch as te
from fp8kit.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# ---- inputs (tests/block_helpers.py: every bf16 bit pattern, the full exponent range) -----------------------------

def special_rows(width, dtype, finite=False):
    """Rows of `width` values, each a special case (zeros, NaN, inf, max, subnormals, amax at 448 * 2^k)."""
    info = torch.finfo(dtype)
    nan, inf = float("nan"), float("inf")
    tiny = info.smallest_normal * 2.0 ** -3 if dtype != torch.float32 else 1e-42
    rows = [[0.0] * width,
            [info.max] * width,
            [-info.max] + [1.0] * (width - 1),
            [tiny] * width,
            [tiny, -tiny / 2] + [0.0] * (width - 2),
            [448.0] + [0.5] * (width - 1),
            [57344.0] + [3.0] * (width - 1),
            [6.0 * 448] + [1.0] * (width - 1),
            [448.0 * 2.0 ** -20] + [2.0 ** -30] * (width - 1),
            [2.0 ** 100] + [2.0 ** -100] * (width - 1)]
    if not finite:
        rows += [[nan] * width, [inf] + [1.0] * (width - 1), [-inf, nan] + [2.0 ** 100] * (width - 2),
                 [nan] + [0.25] * (width - 1)]
    return torch.tensor(rows, dtype=torch.float64).to(dtype)


def make_inputs(small: bool, finite: bool, align: int):
    """(name, tensor) pairs. `align`: the multiple the last two dims need (for NVFP4: 16 / 32), 1 = any."""
    from block_helpers import all_bf16, wide_range  # tests/ (on sys.path through gpu_check_common)

    g = torch.Generator().manual_seed(0)
    out = []
    big = (128, 256) if small else (512, 1024)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        out.append((f"randn_{tuple(big)}_{dtype}", (torch.randn(big, generator=g) * 3).to(dtype)))
        x = wide_range(big, dtype, seed=3)
        out.append((f"wide_range_{tuple(big)}_{dtype}", x))
        # mixed-magnitude columns (blocks with different scales)
        scaled = torch.randn(big, generator=g) * torch.logspace(-6, 6, big[1])
        out.append((f"logspace_cols_{dtype}", scaled.to(dtype)))
    bf = all_bf16((256, 256), True)
    if finite:
        bf = torch.where(torch.isfinite(bf), bf, torch.zeros((), dtype=bf.dtype))
    out.append(("all_bf16_shuffled", bf))
    for dtype in (torch.bfloat16, torch.float32):
        for width in (32, 128):
            rows = special_rows(width, dtype, finite)
            pad = (-rows.shape[0]) % 128
            x = torch.cat([rows, torch.randn(pad, width, generator=g).to(dtype)]).repeat(1, 256 // width)
            out.append((f"special_w{width}_{dtype}", x))
    odd = [(33, 100), (1, 32), (130, 96), (3, 5, 64), (2, 7, 160), (0, 64), (64, 48)]
    for shape in odd:
        if align > 1 and (shape[-1] % align or math.prod(shape[:-1]) % align):
            shape = shape[:-2] + tuple(max(align, (d + align - 1) // align * align) for d in shape[-2:]) \
                if len(shape) >= 2 else shape
        out.append((f"shape_{tuple(shape)}_bf16", (torch.randn(shape, generator=g)).to(torch.bfloat16)))
    out.append(("shape_(33, 100)_raw_bf16", torch.randn(33, 100, generator=g).to(torch.bfloat16)))
    return out


# ---- A. quantizers -------------------------------------------------------------------------------------------------

def _quant_compare(dev, configs, inputs):
    """configs: name -> zero-arg factory of a quantizer. Quantize every input on the CPU and on `dev`."""
    summary = {"n_compared": 0, "n_equal": 0, "n_refused_both": 0, "mismatches": [], "refusal_mismatch": [],
               "configs": list(configs)}
    per_config = {}
    for cname, make in configs.items():
        eq = tot = 0
        for iname, x in inputs:
            case = f"{cname}/{iname}"
            cpu_err = dev_err = None
            try:
                qc = make()(x)
            except Exception as e:  # noqa: BLE001
                cpu_err = e
            try:
                xd = x.to(dev)
                qd = make()(xd)
                _sync(dev)
            except Exception as e:  # noqa: BLE001
                dev_err = e
            if cpu_err is not None or dev_err is not None:
                if cpu_err is not None and dev_err is not None and type(cpu_err) is type(dev_err):
                    summary["n_refused_both"] += 1
                else:
                    summary["refusal_mismatch"].append({"case": case, "cpu": repr(cpu_err)[:300],
                                                        "dev": repr(dev_err)[:300]})
                continue
            tot += 1
            bad = compare_fields(qc, qd)
            if bad:
                summary["mismatches"].append({"case": case, "diff": bad[:4]})
            else:
                eq += 1
        per_config[cname] = {"compared": tot, "equal": eq}
        summary["n_compared"] += tot
        summary["n_equal"] += eq
    summary["per_config"] = per_config
    summary["mismatches"] = summary["mismatches"][:30]
    summary["ok"] = summary["n_compared"] > 0 and summary["n_equal"] == summary["n_compared"] \
        and not summary["refusal_mismatch"]
    summary["short"] = (f"{summary['n_equal']}/{summary['n_compared']} cases bit-equal, "
                        f"{summary['n_refused_both']} refused on both, "
                        f"{len(summary['refusal_mismatch'])} refusal mismatches")
    return summary


def check_quant_mxfp8(dev, small):
    from fp8kit.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    configs = {}
    for fmt in FMTS:
        for two_d in (False, True):
            configs[f"mxfp8_{fmt}_{'2d' if two_d else '1d'}"] = (
                lambda f=FMTS[fmt], t=two_d: MXFP8Quantizer(f, rowwise=True, columnwise=True, with_2d_quantization=t))
    return _quant_compare(dev, configs, make_inputs(small, finite=False, align=1))


def check_quant_float8block(dev, small):
    from fp8kit.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    configs = {}
    for fmt in FMTS:
        for dim in (1, 2):
            for pow2 in (True, False):
                configs[f"block_{fmt}_dim{dim}_{'pow2' if pow2 else 'f32'}"] = (
                    lambda f=FMTS[fmt], d=dim, p=pow2: Float8BlockQuantizer(
                        f, rowwise=True, columnwise=True, block_scaling_dim=d, force_pow_2_scales=p))
    configs["block_e4m3_dim1_eps1e-3"] = lambda: Float8BlockQuantizer(
        torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1, force_pow_2_scales=False,
        amax_epsilon=1e-3)
    return _quant_compare(dev, configs, make_inputs(small, finite=False, align=1))


def check_quant_nvfp4(dev, small):
    from fp8kit.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
    configs = {}
    for two_d in (False, True):
        for rht in (False, True):
            configs[f"nvfp4_{'2d' if two_d else '1d'}_{'rht' if rht else 'northt'}"] = (
                lambda t=two_d, r=rht: NVFP4Quantizer(with_2d_quantization=t, with_rht=r, with_post_rht_amax=r))
    res = _quant_compare(dev, configs, make_inputs(small, finite=False, align=32))
    # stochastic rounding: random bits differ between the CPU and CUDA generators, so only record the agreement
    try:
        x = torch.randn(128, 256)
        qc = NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(1))(x)
        gen = torch.Generator(device=dev).manual_seed(1)
        qd = NVFP4Quantizer(stochastic_rounding=True, generator=gen)(x.to(dev))
        bad = compare_fields(qc, qd)
        res["stochastic_rounding_info"] = {"bit_equal": not bad, "note": "not part of ok: RNG streams differ",
                                           "diff": bad[:3]}
    except Exception:  # noqa: BLE001
        res["stochastic_rounding_info"] = {"error": _tb()}
    return res


# ---- A. Linear under the block recipes ----------------------------------------------------------------------------

class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _linear_step(recipe, dev, w, b, x, dy, count_ops=False):
    layer = te.Linear(w.shape[1], w.shape[0], bias=True, params_dtype=w.dtype, device=dev)
    with torch.no_grad():
        layer.weight.copy_(w.to(dev))
        layer.bias.copy_(b.to(dev))
    xd = x.to(dev).clone().requires_grad_()
    saved = []
    counter = OpCounter() if count_ops else None

    def pack(t):
        saved.append(t)
        return t
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if counter is not None:
            with counter:
                with te.autocast(recipe=recipe):
                    y = layer(xd)
                y.backward(dy.to(dev))
        else:
            with te.autocast(recipe=recipe):
                y = layer(xd)
            y.backward(dy.to(dev))
    _sync(dev)
    quantized = [t for t in saved if isinstance(t, te.QuantizedTensor) or _fields(t)]
    return {"y": y.detach(), "dx": xd.grad, "dw": layer.weight.grad, "db": layer.bias.grad,
            "saved": quantized, "ops": counter.ops if counter else None}


def _qmi_weight(recipe, dev, w):
    def init(p):
        with torch.no_grad():
            p.copy_(w.to(p.device, p.dtype))
    with te.quantized_model_init(enabled=True, recipe=recipe):
        layer = te.Linear(w.shape[1], w.shape[0], params_dtype=w.dtype, device=dev, init_method=init)
    return layer.weight


def check_linear_blocks(dev, small):
    recipes = {"mxfp8": MXFP8BlockScaling(),
               "mxfp8_2d": MXFP8BlockScaling(enable_2d_quantization=True),
               "float8block": Float8BlockScaling(),
               "nvfp4_no_sr": NVFP4BlockScaling(disable_stochastic_rounding=True),
               "nvfp4_default": NVFP4BlockScaling()}
    m, k, n = (64, 256, 96) if small else (256, 1024, 512)
    out = {"shape_mkn": [m, k, n], "per_recipe": {}}
    cap = torch.cuda.get_device_capability() if dev.type == "cuda" else None
    out["compute_capability"] = list(cap) if cap else None
    all_ok = True
    for rname, recipe in recipes.items():
        for dtype in (torch.bfloat16, torch.float32):
            key = f"{rname}_{str(dtype).split('.')[-1]}"
            try:
                g = torch.Generator().manual_seed(5)
                w = (torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)).to(dtype)
                b = torch.randn(n, generator=g).to(dtype)
                x = torch.randn(m, k, generator=g).to(dtype)
                dy = (torch.randn(m, n, generator=g) * 1e-2).to(dtype)
                rc = _linear_step(recipe, torch.device("cpu"), w, b, x, dy)
                rd = _linear_step(recipe, dev, w, b, x, dy)
                x64, w64, dy64 = x.double(), w.double(), dy.double()
                ref = {"y": x64 @ w64.T + b.double(), "dx": dy64 @ w64, "dw": dy64.T @ x64, "db": dy64.sum(0)}
                r = {"bit_equal_vs_cpu": {}, "rel_err_vs_cpu": {}, "rel_err_dev_vs_f64": {},
                     "rel_err_cpu_vs_f64": {}}
                for t in ("y", "dx", "dw", "db"):
                    r["bit_equal_vs_cpu"][t] = bits_equal(rc[t], rd[t])
                    r["rel_err_vs_cpu"][t] = rel(rd[t], rc[t])
                    r["rel_err_dev_vs_f64"][t] = rel(rd[t], ref[t])
                    r["rel_err_cpu_vs_f64"][t] = rel(rc[t], ref[t])
                r["finite"] = all(bool(torch.isfinite(rd[t]).all()) for t in ("y", "dx", "dw", "db"))
                # quantized tensors saved for backward (input and weight), CPU vs device, bit for bit
                sc, sd = rc["saved"], rd["saved"]
                r["saved_quantized"] = [type(t).__name__ for t in sd]
                saved_bad = [] if len(sc) == len(sd) and sc else [{"count": [len(sc), len(sd)]}]
                for a, c in zip(sc, sd):
                    saved_bad += compare_fields(a, c)
                r["saved_fp8_bytes_equal"] = not saved_bad
                if saved_bad:
                    r["saved_diff"] = saved_bad[:4]
                # quantized_model_init weights, CPU vs device
                try:
                    qc, qd = _qmi_weight(recipe, torch.device("cpu"), w), _qmi_weight(recipe, dev, w)
                    wbad = compare_fields(qc, qd)
                    r["qmi_weight_type"] = type(qd).__name__
                    r["qmi_weight_bytes_equal"] = not wbad
                    if wbad:
                        r["qmi_diff"] = wbad[:4]
                except Exception:  # noqa: BLE001
                    r["qmi_weight_bytes_equal"] = None
                    r["qmi_error"] = _tb()
                if dtype == torch.bfloat16:  # which GEMM path ran: aten ops of one more step, counted
                    try:
                        ops = _linear_step(recipe, dev, w, b, x, dy, count_ops=True)["ops"]
                    except Exception:  # noqa: BLE001
                        ops = None
                        r["op_count_error"] = _tb()
                if dtype == torch.bfloat16 and ops is not None:
                    r["scaled_mm_calls"] = sum(v for kk, v in ops.items() if "scaled_mm" in kk)
                    r["mm_like_ops"] = {kk: v for kk, v in ops.items()
                                        if any(s in kk for s in ("mm", "matmul", "bmm", "einsum", "dot"))}
                    r["gemm_path"] = "native torch._scaled_mm" if r["scaled_mm_calls"] else \
                        "emulated (fp8kit block_gemm / nvfp4_gemm with torch ops)"
                # tolerance: the CUDA result within the CPU's distance from float64 (x2 + tiny) for every output
                tol_ok = all(r["rel_err_dev_vs_f64"][t] <= 2 * r["rel_err_cpu_vs_f64"][t] + 1e-6
                             for t in ("y", "dx", "dw", "db"))
                exact_expected = rname != "nvfp4_default"  # stochastic rounding draws from different RNGs
                r["within_tolerance"] = tol_ok
                r["ok"] = r["finite"] and tol_ok and (not exact_expected or r["saved_fp8_bytes_equal"]) \
                    and r.get("qmi_weight_bytes_equal") is not False
                if rname == "nvfp4_default":
                    r["note"] = ("stochastic rounding of dy: CPU and CUDA RNG streams differ; grads compared by "
                                 "tolerance")
            except Exception:  # noqa: BLE001
                r = {"ok": False, "error": _tb()}
            all_ok &= bool(r.get("ok"))
            out["per_recipe"][key] = r
    hopper_native = {"mxfp8": False, "nvfp4": False, "float8block": True}
    out["emulation_note"] = (
        "fp8kit emulates every block-scaled GEMM (MXFP8, Float8 block, NVFP4) with torch ops on all devices "
        "(block_gemm.py / nvfp4_gemm.py); Hopper (sm_90) has no native MXFP8/NVFP4 GEMM anyway "
        f"(TE native on Hopper: {hopper_native}); casts are torch ops too. cap={out['compute_capability']}")
    out["ok"] = all_ok
    per = out["per_recipe"]

    def count(pred):
        return f"{sum(1 for v in per.values() if pred(v))}/{len(per)}"
    not_bit = [kk for kk, v in per.items() if not all(v.get("bit_equal_vs_cpu", {"x": False}).values())]
    paths = sorted({v["gemm_path"] for v in per.values() if "gemm_path" in v})
    out["short"] = (f"ok {count(lambda v: v.get('ok'))}; y/dx/dW/db bit-equal to CPU {count(lambda v: v.get('bit_equal_vs_cpu') and all(v['bit_equal_vs_cpu'].values()))}"  # noqa: E501
                    f" (not: {not_bit}); saved quantized x/W bytes equal {count(lambda v: v.get('saved_fp8_bytes_equal'))}"  # noqa: E501
                    f"; quantized_model_init W bytes equal {count(lambda v: v.get('qmi_weight_bytes_equal'))}; "
                    f"GEMM path: {paths}")
    return out


# ---- driver ---------------------------------------------------------------------------------------------------------

CHECKS = [("quant_mxfp8", check_quant_mxfp8), ("quant_float8block", check_quant_float8block),
          ("quant_nvfp4", check_quant_nvfp4), ("linear_blocks", check_linear_blocks),
          ("fsdp_current", check_fsdp_current), ("fsdp_delayed", check_fsdp_delayed)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=90.0)
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--sizes", default="auto", choices=["auto", "small", "large"],
                    help="auto: small on the CPU, large elsewhere")
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = torch.device(args.device)
    small = dev.type == "cpu" if args.sizes == "auto" else args.sizes == "small"
    meta = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(dev), "small_sizes": small,
            "budget_s": args.budget}
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        meta["triton"] = None
    if dev.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name()
        meta["capability"] = list(torch.cuda.get_device_capability())
    if dev.type == "cpu":
        meta["note"] = "device cpu: every comparison is CPU vs CPU (dry run of the logic)"
    results = {"meta": meta, "checks": {}}

    def write():
        results["meta"]["elapsed_s"] = round(time.perf_counter() - t0, 2)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(tmp, args.out)

    write()
    only = {s for s in args.only.split(",") if s}
    for name, fn in CHECKS:
        if only and name not in only:
            continue
        if time.perf_counter() - t0 > args.budget:
            results["checks"][name] = {"ok": None, "skipped": "budget spent"}
            print(f"[{name}] SKIPPED (budget)", flush=True)
            write()
            continue
        t1 = time.perf_counter()
        try:
            r = fn(dev, small)
        except Exception:  # noqa: BLE001
            r = {"ok": False, "error": _tb()}
        r["seconds"] = round(time.perf_counter() - t1, 2)
        results["checks"][name] = r
        write()
        msg = r.get("short") or (r.get("error", "").strip().splitlines() or [""])[-1]
        print(f"[{name}] ok={r.get('ok')} {r['seconds']}s: {msg}", flush=True)
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
            results["meta"]["process_group_destroyed"] = True
    except Exception:  # noqa: BLE001
        results["meta"]["destroy_error"] = _tb()
    results["meta"]["all_ok"] = all(c.get("ok") for c in results["checks"].values())
    write()
    print(f"done in {time.perf_counter() - t0:.1f}s, all_ok={results['meta']['all_ok']}", flush=True)


if __name__ == "__main__":
    main()
