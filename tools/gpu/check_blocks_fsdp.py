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
import socket
import sys
import time
import traceback

import numpy as np
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.recipe import (  # noqa: E402
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

FIELDS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv", "_amax_rowwise",
          "_amax_columnwise", "_data", "_scale_inv", "_transpose")
FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# ---- helpers -------------------------------------------------------------------------------------------------------

def _tb() -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-40:])


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of t's bytes on the CPU (bitwise comparison, NaN == NaN of the same pattern)."""
    t = t.detach().contiguous().cpu()
    if t.dtype.is_floating_point or t.dtype.itemsize == 1:
        size = t.element_size()
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    return t


def _fields(q) -> dict:
    out = {}
    for name in FIELDS:
        v = getattr(q, name, None)
        if isinstance(v, torch.Tensor):
            out[name] = v
    return out


def compare_fields(a, b) -> list:
    """Mismatches between the tensor fields of quantized tensors a (CPU) and b (device), bit for bit."""
    fa, fb = _fields(a), _fields(b)
    bad = []
    if sorted(fa) != sorted(fb):
        bad.append({"fields": [sorted(fa), sorted(fb)]})
    if not fa:
        bad.append({"fields": "no tensor fields found"})
    for name in sorted(set(fa) & set(fb)):
        x, y = _bits(fa[name]), _bits(fb[name])
        if x.shape != y.shape or x.dtype != y.dtype:
            bad.append({"field": name, "shape": [list(x.shape), list(y.shape)], "dtype": [str(x.dtype), str(y.dtype)]})
            continue
        if not torch.equal(x, y):
            diff = (x != y).nonzero()
            first = tuple(diff[0].tolist())
            bad.append({"field": name, "n_diff": int(diff.shape[0]), "numel": x.numel(), "first_index": list(first),
                        "cpu_bits": int(x[first]), "dev_bits": int(y[first])})
    return bad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = b.abs().max().item()
    num = (a - b).abs().max().item()
    return num / den if den > 0 else num


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(_bits(a), _bits(b)))


# ---- inputs (self-contained versions of tests/block_helpers.py) ----------------------------------------------------

def all_bf16(shape, seed=0):
    bits = np.random.default_rng(seed).permutation(np.arange(65536, dtype=np.uint16))
    return torch.from_numpy(bits.astype(np.int16).reshape(shape)).view(torch.bfloat16)


def wide_range(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    lo, hi = int(np.log2(info.smallest_normal)) - info.bits // 4, int(np.log2(info.max))
    e = torch.randint(lo, hi + 1, shape, generator=g).double()
    m = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
    s = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    return (s * m * torch.pow(2.0, e)).clamp(-info.max, info.max).to(dtype)


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
    bf = all_bf16((256, 256))
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


# ---- B. FSDP2 with FP8 weights, world size 1 ------------------------------------------------------------------------

SIZES = [(64, 96), (96, 33), (33, 64)]


class WireRecorder:
    NAMES = ("all_gather_single", "all_gather_into_tensor", "all_gather")

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.events, self.active, self.saved = dist, [], False, {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(self.dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                if self.active:
                    inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
                    if isinstance(inp, torch.Tensor):
                        self.events.append((_name, str(inp.dtype), inp.numel() * inp.element_size()))
                    else:
                        self.events.append((_name, type(inp).__name__, None))
                return _fn(*args, **kwargs)
            setattr(self.dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PG = {"up": False}


def _ensure_pg(dev):
    import torch.distributed as dist
    if dist.is_initialized():
        return
    backend = "nccl" if dev.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    kwargs = {}
    if dev.type == "cuda":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    try:
        dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                **kwargs)
    except TypeError:
        dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    _PG["up"] = True


def _build(recipe, dev, shard: bool, seed=0):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    with te.quantized_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=True):
        layers = [te.Linear(i, o, params_dtype=torch.bfloat16, device=dev) for i, o in SIZES]
    model = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1], torch.nn.GELU(), layers[2])
    init = {nm: p.get_high_precision_init_val() for nm, p in model.named_parameters()
            if isinstance(p, te.Float8Tensor)}
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(dev.type, (1,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = te.optimizers.FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01, master_weights=True)
    for nm, p in model.named_parameters():
        if nm in init:
            opt.set_scaled_state(p, "master_param", init[nm].to(dev))
    return model, opt


def _local(p):
    return getattr(p, "_local_tensor", p)


def _fp8_bytes(t):
    return t._data.contiguous().view(torch.uint8)


def _train(model, opt, recipe, batches, rec=None):
    losses, events = [], []
    for x, target in batches:
        if rec is not None:
            rec.active = True
        with te.autocast(recipe=recipe):
            loss = (model(x).float() - target).square().mean()
        loss.backward()
        if rec is not None:
            rec.active = False
            events.append(rec.events)
            rec.events = []
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses).cpu(), events


class PreAllGatherRecorder:
    """Wraps Float8Tensor.fsdp_pre_all_gather (FSDP2's all-gather extension) and records the inputs' dtypes and bytes
    (at world size 1 FSDP2 skips the collective itself but still takes the all-gather inputs from this method)."""

    def __enter__(self):
        self.events, self.cls = [], te.Float8Tensor
        self.orig = self.cls.__dict__.get("fsdp_pre_all_gather")
        orig = self.cls.fsdp_pre_all_gather
        import functools

        @functools.wraps(orig)  # FSDP2 checks the signature
        def wrapper(tensor, *args, **kwargs):
            out = orig(tensor, *args, **kwargs)
            try:
                inputs = out[0]
                self.events.append([(str(t.dtype), t.numel() * t.element_size()) for t in inputs])
            except Exception:  # noqa: BLE001
                self.events.append(repr(type(out)))
            return out
        self.cls.fsdp_pre_all_gather = wrapper
        return self

    def __exit__(self, *exc):
        if self.orig is not None:
            self.cls.fsdp_pre_all_gather = self.orig
        else:
            del self.cls.fsdp_pre_all_gather


def _explicit_gather(model, dev):
    """Each FP8 shard through fsdp_pre_all_gather -> a real all_gather_into_tensor on the process group (NCCL on
    CUDA) -> fsdp_post_all_gather: uint8 on the wire, the gathered Float8Tensor equals the shard bit for bit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(dev.type, (1,))
    bad, n = [], 0
    for nm, p in model.named_parameters():
        sh = _local(p)
        if not isinstance(sh, te.Float8Tensor):
            continue
        n += 1
        (inp,), meta = sh.fsdp_pre_all_gather(mesh, sh.shape, None, None, None)
        if inp.dtype != torch.uint8:
            bad.append({"param": nm, "wire_dtype": str(inp.dtype)})
        out = torch.empty((dist.get_world_size() * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype,
                          device=inp.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, inp.contiguous())
        _sync(dev)
        full, _ = sh.fsdp_post_all_gather((out,), meta, torch.bfloat16)
        if not isinstance(full, te.Float8Tensor) or full._data.dtype != torch.uint8:
            bad.append({"param": nm, "type": type(full).__name__})
            continue
        if not torch.equal(_fp8_bytes(full).cpu(), _fp8_bytes(sh).cpu()) or not bits_equal(full._scale_inv,
                                                                                            sh._scale_inv):
            bad.append({"param": nm, "what": "gathered bytes/scale differ"})
        if not bits_equal(full.dequantize(), sh.dequantize()):
            bad.append({"param": nm, "what": "dequantized differ"})
    return {"n_weights": n, "ok": n == 3 and not bad, "diffs": bad}


def _delayed_states(model) -> dict:
    """{"linear<i>.scaling_fwd|bwd": (amax_history, scale)} copied (empty without delayed-scaling state)."""
    out = {}
    for i, mm in enumerate(m for m in model if isinstance(m, te.Linear)):
        for k in ("scaling_fwd", "scaling_bwd"):
            st = mm.fp8_meta.get(k) if isinstance(mm.fp8_meta, dict) else None
            if st is not None and hasattr(st, "amax_history"):
                out[f"linear{i}.{k}"] = (st.amax_history.detach().clone().cpu(), st.scale.detach().clone().cpu())
    return out


def _fsdp_check(dev, recipe, small):
    import torch.distributed as dist

    from fp8kit.pytorch import distributed as fdist
    _ensure_pg(dev)
    steps = 6
    gen = torch.Generator().manual_seed(50)
    batches = [(torch.randn(16, 64, generator=gen).to(torch.bfloat16).to(dev),
                torch.randn(16, 64, generator=gen).to(dev))] * steps  # one batch, fitted: the loss must go down
    res = {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "steps": steps}
    with WireRecorder() as rec, PreAllGatherRecorder() as pre:
        fmodel, fopt = _build(recipe, dev, shard=True)
        f_losses, events = _train(fmodel, fopt, recipe, batches, rec=rec)
    # each model's delayed-scaling state is read right after its own training (and its deferred backward update):
    # both models register under one key (same recipe, same group), and a registered model takes part in every
    # update of its key even when idle (Transformer Engine's rule too), so the plain model's first forward update
    # rolls in the amax the FSDP model's last optimizer step staged in its weight slot
    fdist.apply_pending_updates()
    f_states = _delayed_states(fmodel)
    pmodel, popt = _build(recipe, dev, shard=False)
    p_losses, _ = _train(pmodel, popt, recipe, batches)
    fdist.apply_pending_updates()
    p_states = _delayed_states(pmodel)
    _sync(dev)
    res["losses_fsdp"] = f_losses.tolist()
    res["losses_plain"] = p_losses.tolist()
    res["losses_bit_equal"] = bits_equal(f_losses, p_losses)
    res["loss_decreased"] = bool(f_losses[-1] < f_losses[0])
    # what FSDP2 puts on the wire: the all-gather inputs from the FP8 extension, and the collectives called
    want_bytes = sorted({o * i for i, o in SIZES})
    pre_flat = [e for ev in pre.events if isinstance(ev, list) for e in ev]
    res["pre_all_gather_calls"] = len(pre.events)
    res["pre_all_gather_dtypes"] = sorted({d for d, _ in pre_flat})
    res["pre_all_gather_bytes"] = sorted({b for _, b in pre_flat})
    res["expected_fp8_weight_bytes"] = want_bytes
    res["wire_inputs_fp8"] = bool(pre_flat) and res["pre_all_gather_dtypes"] == ["torch.uint8"] \
        and res["pre_all_gather_bytes"] == want_bytes
    flat = [e for step in events for e in step]
    res["collective_events_step0"] = events[0] if events else []
    res["collective_dtypes"] = sorted({e[1] for e in flat})
    res["fsdp_skipped_collective_at_ws1"] = not any(e[0] in ("all_gather_single", "all_gather_into_tensor")
                                                    for e in flat)
    # parameters: the FSDP shards (world 1: the whole tensor) vs the plain model's
    pbad = []
    for (nm, a), (_, b) in zip(fmodel.named_parameters(), pmodel.named_parameters()):
        la = _local(a)
        if isinstance(b, te.Float8Tensor):
            if not isinstance(la, te.Float8Tensor):
                pbad.append({"param": nm, "type": type(la).__name__})
                continue
            if not torch.equal(_fp8_bytes(la).cpu(), _fp8_bytes(b).cpu()):
                pbad.append({"param": nm, "what": "fp8 bytes",
                             "n_diff": int((_fp8_bytes(la).cpu() != _fp8_bytes(b).cpu()).sum())})
            if not bits_equal(la._scale_inv, b._scale_inv):
                pbad.append({"param": nm, "what": "scale_inv", "vals": [float(la._scale_inv.reshape(-1)[0]),
                                                                       float(b._scale_inv.reshape(-1)[0])]})
        elif not bits_equal(la, b):
            pbad.append({"param": nm, "what": "values", "rel": rel(la, b)})
    for (nm, a), (_, b) in zip(fmodel.named_parameters(), pmodel.named_parameters()):
        sa, sb = fopt.state.get(a, {}), popt.state.get(b, {})
        for key in sorted(set(sa) & set(sb)):
            va, vb = sa[key], sb[key]
            va = va.to_local() if hasattr(va, "to_local") else va
            if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and not bits_equal(va, vb):
                pbad.append({"param": nm, "what": f"opt.{key}", "rel": rel(va, vb)})
    res["params_bit_equal"] = not pbad
    res["param_diffs"] = pbad[:8]
    # the gathered weight in a forward: Float8Tensor with uint8 bytes equal to the shard's
    seen = []
    linears = [mm for mm in fmodel if isinstance(mm, te.Linear)]
    hooks = [mm.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.detach().clone()))
             for mm in linears]
    with torch.no_grad(), te.autocast(recipe=recipe):
        out_f = fmodel(batches[0][0])
    for h in hooks:
        h.remove()
    with torch.no_grad(), te.autocast(recipe=recipe):
        out_p = pmodel(batches[0][0])
    gbad = []
    for layer, w in zip(linears, seen):
        if not isinstance(w, te.Float8Tensor) or w._data.dtype != torch.uint8:
            gbad.append({"type": type(w).__name__, "dtype": str(getattr(w, "_data", w).dtype)})
            continue
        sh = _local(layer.weight)
        if not torch.equal(_fp8_bytes(w).cpu(), _fp8_bytes(sh).cpu()) or not bits_equal(w._scale_inv, sh._scale_inv):
            gbad.append({"what": "gathered bytes/scale differ from the shard"})
    res["gathered_is_fp8_uint8"] = len(seen) == 3 and not gbad
    res["gathered_diffs"] = gbad
    res["eval_output_bit_equal"] = bits_equal(out_f, out_p)
    try:
        res["explicit_collective"] = _explicit_gather(fmodel, dev)
    except Exception:  # noqa: BLE001
        res["explicit_collective"] = {"ok": False, "error": _tb()}
    if f_states:  # DelayedScaling: the modules' delayed-scaling states, each read right after its training
        info = {}
        for name in f_states:
            (ha, sa), (hb, sb) = f_states[name], p_states[name]
            if not (bits_equal(sa, sb) and bits_equal(ha, hb)):
                info[name] = {"scale_fsdp": sa.tolist(), "scale_plain": sb.tolist(), "hist_fsdp": ha.tolist(),
                              "hist_plain": hb.tolist()}
        res["info_delayed_state_equal"] = not info and len(f_states) == 6
        res["info_delayed_state_diffs"] = info
    res["ok"] = res["losses_bit_equal"] and res["params_bit_equal"] and res["gathered_is_fp8_uint8"] \
        and res["wire_inputs_fp8"] and res["loss_decreased"] and res["eval_output_bit_equal"] \
        and bool(res["explicit_collective"].get("ok")) and res.get("info_delayed_state_equal", True)
    res["short"] = (f"{res['backend']} ws1: losses bit-equal={res['losses_bit_equal']}, params bit-equal="
                    f"{res['params_bit_equal']}, wire inputs uint8={res['wire_inputs_fp8']}, gathered FP8 uint8="
                    f"{res['gathered_is_fp8_uint8']}, explicit {res['backend']} all-gather ok="
                    f"{res['explicit_collective'].get('ok')}, eval out equal={res['eval_output_bit_equal']}"
                    + (f", delayed state equal (info)={res['info_delayed_state_equal']}"
                       if "info_delayed_state_equal" in res else ""))
    del fmodel, fopt, pmodel, popt
    import gc
    gc.collect()
    return res


def check_fsdp_current(dev, small):
    return _fsdp_check(dev, Float8CurrentScaling(), small)


def check_fsdp_delayed(dev, small):
    return _fsdp_check(dev, DelayedScaling(amax_history_len=4), small)


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
