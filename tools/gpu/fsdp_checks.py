"""GPU check B of tools/gpu/check_blocks_fsdp.py: FSDP2 (fully_shard) with FP8 weights (quantized_model_init),
world size 1, in-process (nccl on CUDA, gloo on CPU); see that file's docstring."""

from __future__ import annotations

import os
import socket

import torch
from gpu_check_common import _sync, _tb, bits_equal, rel

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

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
