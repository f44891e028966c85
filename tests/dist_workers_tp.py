"""The tensor-parallel multi-process checks (run by tests/dist_workers.py): fp8kit's column/row-parallel Linear,
with and without sequence parallelism, against a single-process model holding the full weights."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
import torch.distributed as dist

import fp8kit.pytorch as te
from fp8kit.pytorch import distributed as fdist
from fp8kit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling

import reference as ref
from dist_common import (
    E4M3,
    E5M2,
    RANK,
    WORLD,
    Recorder,
    assert_same_on_all_ranks,
    names,
    state_np,
)
from linear_helpers import np32, sqnr_db

# ---- check: tensor-parallel Linear against a single-process model holding the full weights ----------------------

def _tp_case(mode, sp, recipe, dtype=torch.float32, steps=3):
    """Returns the worst SQNR (dB) of TP vs single-process over outputs and gradients, and the recorded gathers."""
    tp_group = dist.group.WORLD
    torch.manual_seed(5)
    s, b, h_in, h_out = 8, 2, 32, 64
    full = te.Linear(h_in, h_out, params_dtype=dtype)
    tp = te.Linear(h_in, h_out, params_dtype=dtype, parallel_mode=mode, tp_group=tp_group, sequence_parallel=sp)
    fdist.shard_linear_parameters(tp, full.weight, full.bias)
    local_recipe = dataclasses.replace(recipe, reduce_amax=False) if isinstance(recipe, DelayedScaling) else recipe
    worst, gathers = 1e9, []
    out_shard = slice(RANK * h_out // WORLD, (RANK + 1) * h_out // WORLD)
    in_shard = slice(RANK * h_in // WORLD, (RANK + 1) * h_in // WORLD)
    seq_shard = slice(RANK * s // WORLD, (RANK + 1) * s // WORLD)
    for step in range(steps):
        gen = torch.Generator().manual_seed(300 + step)  # the same full tensors on every rank
        x = (torch.randn(s, b, h_in, generator=gen) * (1 + step)).to(dtype)
        g = (torch.randn(s, b, h_out, generator=gen) * (1 + 2 * step)).to(dtype)
        xf = x.clone().requires_grad_()
        with te.autocast(recipe=local_recipe):
            yf = full(xf)
        yf.backward(g)
        if mode == "column":
            x_in = x[seq_shard] if sp else x
            g_out, y_want = g[..., out_shard], yf[..., out_shard]
            dx_want = xf.grad[seq_shard] if sp else xf.grad
            dw_want, db_want = full.weight.grad[out_shard], full.bias.grad[out_shard]
        else:
            x_in = x[..., in_shard]
            g_out, y_want = (g[seq_shard], yf[seq_shard]) if sp else (g, yf)
            dx_want = xf.grad[..., in_shard]
            dw_want, db_want = full.weight.grad[:, in_shard], full.bias.grad
        xt = x_in.clone().requires_grad_()
        scales = [float(tp.fp8_meta[w].scale[0]) for w in ("scaling_fwd", "scaling_bwd")] \
            if tp.fp8_meta["scaling_fwd"] is not None else [1.0, 1.0]
        with Recorder() as rec:
            rec.active = True
            with te.autocast(recipe=recipe):
                yt = tp(xt)
            fwd_events = rec.take()
            yt.backward(g_out)
            bwd_events = rec.take()
        gathers.append((x, g, scales, fwd_events, bwd_events))
        exact = x.double() @ full.weight.detach().double().T + full.bias.detach().double()
        exact = exact[..., out_shard] if mode == "column" else (exact[seq_shard] if sp else exact)
        assert sqnr_db(exact.numpy(), np32(yt)) < 50, "the output looks high precision, not FP8"
        for got, want, what in ((yt, y_want, "y"), (xt.grad, dx_want, "dx"), (tp.weight.grad, dw_want, "dW"),
                                (tp.bias.grad, db_want, "db")):
            assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            worst = min(worst, sqnr_db(np32(want), np32(got)))
        full.weight.grad = full.bias.grad = tp.weight.grad = tp.bias.grad = None
        if isinstance(recipe, DelayedScaling):
            fdist.apply_pending_updates()
            for w in ("scaling_fwd", "scaling_bwd"):  # amax reduction over TP = the full tensors' amaxes
                hf, sf = state_np(full, w)
                ht, st = state_np(tp, w)
                assert np.array_equal(hf, ht) and np.array_equal(sf, st), f"{mode} sp={sp} {w}: {ht} != {hf}"
    return worst, gathers


def _fp8_gathers(events):
    return [e for e in events if e[0] in ("all_gather_single", "all_gather_into_tensor")]


def _tp_high_precision_case(mode, sp):
    """Outside autocast a tensor-parallel layer runs the same collectives around float32 GEMMs."""
    torch.manual_seed(6)
    full = te.Linear(32, 64)
    tp = te.Linear(32, 64, parallel_mode=mode, tp_group=dist.group.WORLD, sequence_parallel=sp)
    fdist.shard_linear_parameters(tp, full.weight, full.bias)
    x = torch.randn(8, 2, 32, dtype=torch.float64)
    w, b = full.weight.detach().double(), full.bias.detach().double()
    want = x @ w.T + b
    parts = {"column": (slice(None), slice(RANK * 32, RANK * 32 + 32), slice(None)),
             "row": (slice(None), slice(None), slice(RANK * 16, RANK * 16 + 16))}[mode]
    seq = slice(RANK * 4, RANK * 4 + 4)
    x_in = x[parts[0], :, parts[2]]
    if mode == "column" and sp:
        x_in = x[seq]
    got = tp(x_in.float())
    want = want[..., parts[1]]
    if mode == "row" and sp:
        want = want[seq]
    assert got.shape == want.shape and sqnr_db(want.numpy(), np32(got)) >= 120, (mode, sp)


def check_tp_linear():
    layer = te.Linear(32, 64, parallel_mode="column", tp_group=dist.group.WORLD, sequence_parallel=True)
    clone = copy.deepcopy(layer)  # e.g. an EMA copy: the process group is shared, not copied
    assert clone.tp_group is layer.tp_group and clone.weight.shape == (32, 32) and clone.in_features == 32
    try:  # delayed scaling without amax reduction cannot share the scale the FP8 all-gather needs
        with te.autocast(recipe=DelayedScaling(reduce_amax=False)):
            layer(torch.randn(4, 2, 32))
    except ValueError as e:
        assert "same scale on every tensor-parallel rank" in str(e), str(e)
    else:
        raise AssertionError("no error for sequence parallelism without amax reduction")
    for mode in ("column", "row"):
        for sp in (False, True):
            _tp_high_precision_case(mode, sp)
            for recipe in (DelayedScaling(amax_history_len=4), Float8CurrentScaling()):
                worst, runs = _tp_case(mode, sp, recipe)
                # the contract is 30 dB; both sides cast the same FP8 bytes, so only float32 summation order differs
                assert worst >= 80, f"{mode} sp={sp} {type(recipe).__name__}: SQNR {worst:.1f} dB vs single-process"
                for x, g, (fwd_scale, bwd_scale), fwd, bwd in runs:
                    gathered_fwd, gathered_bwd = _fp8_gathers(fwd), _fp8_gathers(bwd)
                    if not sp:
                        assert gathered_fwd == gathered_bwd == []
                        continue
                    # the gather moved FP8 bytes: uint8, one byte per element of the full tensor
                    full_t, gathered, fmt, fp8_max, scale = (x, gathered_fwd, "e4m3", E4M3, fwd_scale) \
                        if mode == "column" else (g, gathered_bwd, "e5m2", E5M2, bwd_scale)
                    assert len(gathered) == 1 and gathered[0][1] == torch.uint8, [e[:3] for e in gathered]
                    assert gathered[0][2] == full_t.numel(), (gathered[0][2], full_t.numel())
                    if isinstance(recipe, Float8CurrentScaling):
                        scale = ref.current_scale(ref.amax(np32(full_t)), fp8_max)
                        events = fwd if mode == "column" else bwd
                        first = names(events).index(gathered[0][0])
                        assert "all_reduce" in names(events)[:first], "no amax all-reduce before the FP8 gather"
                    want, _ = ref.cast(np32(full_t).reshape(-1, full_t.shape[-1]), fmt, scale)
                    assert np.array_equal(gathered[0][3].numpy(), want), "gathered bytes != reference cast"


def check_tp_mlp_bf16():
    """Column (SP) -> GELU -> row (SP) in bfloat16 with SGD steps, against the same block on one process."""
    recipe = DelayedScaling(amax_history_len=8)
    local_recipe = DelayedScaling(amax_history_len=8, reduce_amax=False)
    torch.manual_seed(7)
    s, b, h, f = 16, 2, 32, 64
    full = [te.Linear(h, f, params_dtype=torch.bfloat16), te.Linear(f, h, params_dtype=torch.bfloat16)]
    tp = [te.Linear(h, f, params_dtype=torch.bfloat16, parallel_mode="column", tp_group=dist.group.WORLD,
                    sequence_parallel=True),
          te.Linear(f, h, params_dtype=torch.bfloat16, parallel_mode="row", tp_group=dist.group.WORLD,
                    sequence_parallel=True)]
    for ft, tt in zip(full, tp):
        fdist.shard_linear_parameters(tt, ft.weight, ft.bias)
    opt_full = torch.optim.SGD([p for m in full for p in m.parameters()], lr=0.05)
    opt_tp = torch.optim.SGD([p for m in tp for p in m.parameters()], lr=0.05)
    seq = slice(RANK * s // WORLD, (RANK + 1) * s // WORLD)
    with Recorder() as rec:
        for step in range(3):
            gen = torch.Generator().manual_seed(400 + step)
            x = torch.randn(s, b, h, generator=gen).to(torch.bfloat16)
            g = torch.randn(s, b, h, generator=gen).to(torch.bfloat16)
            with te.autocast(recipe=local_recipe):
                yf = full[1](torch.nn.functional.gelu(full[0](x)))
            yf.backward(g)
            rec.active = True
            with te.autocast(recipe=recipe):
                yt = tp[1](torch.nn.functional.gelu(tp[0](x[seq])))
            gathers = _fp8_gathers(rec.take())
            rec.active = False
            assert yt.shape == (s // WORLD, b, h) and yt.dtype == torch.bfloat16
            assert [(e[1], e[2]) for e in gathers] == [(torch.uint8, s * b * h)], [e[:3] for e in gathers]
            # half the bytes of gathering the bfloat16 input
            assert gathers[0][2] * 1 == x.numel() * x.element_size() // 2
            yt.backward(g[seq])
            assert sqnr_db(np32(yf[seq]), np32(yt)) >= 30, sqnr_db(np32(yf[seq]), np32(yt))
            shards = [(full[0].weight.grad.chunk(WORLD, 0)[RANK], tp[0].weight.grad),
                      (full[1].weight.grad.chunk(WORLD, 1)[RANK], tp[1].weight.grad),
                      (full[1].bias.grad, tp[1].bias.grad)]
            for want, got in shards:
                assert sqnr_db(np32(want), np32(got)) >= 30, sqnr_db(np32(want), np32(got))
            opt_full.step(), opt_tp.step(), opt_full.zero_grad(), opt_tp.zero_grad()
    assert_same_on_all_ranks([m.fp8_meta[w].scale for m in tp for w in ("scaling_fwd", "scaling_bwd")], "scales")
    assert_same_on_all_ranks([tp[1].bias], "row-parallel bias")



def check_tp_dp_4_ranks():
    """4 ranks: tensor parallel 2 (groups {0,1} and {2,3}) x data parallel 2, amax reduced over all 4 ranks."""
    tp_ranks = [[0, 1], [2, 3]]
    groups = [dist.new_group(r) for r in tp_ranks]
    tp_group = groups[RANK // 2]
    torch.manual_seed(31)
    s, b, h, f = 8, 2, 32, 64
    full = [te.Linear(h, f), te.Linear(f, h)]
    tp = [te.Linear(h, f, parallel_mode="column", tp_group=tp_group, sequence_parallel=True),
          te.Linear(f, h, parallel_mode="row", tp_group=tp_group, sequence_parallel=True)]
    for ft, tt in zip(full, tp):
        fdist.shard_linear_parameters(tt, ft.weight, ft.bias)
    tp_rank, dp_rank = RANK % 2, RANK // 2
    recipe = DelayedScaling(amax_history_len=4)
    local = DelayedScaling(amax_history_len=4, reduce_amax=False)
    seq = slice(tp_rank * s // 2, (tp_rank + 1) * s // 2)
    for step in range(3):
        xs = [torch.randn(s, b, h, generator=torch.Generator().manual_seed(800 + 10 * step + d)) * (1 + d)
              for d in range(2)]
        with te.autocast(recipe=recipe):
            yt = tp[1](torch.relu(tp[0](xs[dp_rank][seq])))
        yt.sum().backward()
        with te.autocast(recipe=local):  # the single-process twin sees both data-parallel batches
            yf = full[1](torch.relu(full[0](torch.cat(xs, dim=1))))
        yf.sum().backward()
        want = yf[:, dp_rank * b:(dp_rank + 1) * b][seq]
        assert sqnr_db(np32(want), np32(yt)) >= 30
    fdist.apply_pending_updates()
    for ft, tt in zip(full, tp):  # amaxes reduced over TP x DP = the whole tensors' (up to GEMM rounding)
        for w in ("scaling_fwd", "scaling_bwd"):
            hf, sf = state_np(ft, w)
            ht, st = state_np(tt, w)
            np.testing.assert_allclose(ht, hf, rtol=1e-5)
            np.testing.assert_allclose(st, sf, rtol=1e-5)
    assert_same_on_all_ranks([tt.fp8_meta[w].scale for tt in tp for w in ("scaling_fwd", "scaling_bwd")], "scales")



# ---- check: block-scaled recipes under tensor and sequence parallelism ------------------------------------------

def _block_tp_case(mode, recipe):
    """A column- or row-parallel Linear with sequence parallelism against, on each rank, a single-process Linear
    holding the same weight shard and fed the full tensors: the sequence all-gather of the input (column) and of the
    gradient (row) moves high-precision values and quantizes the full tensor, so each GEMM sees the bytes a single
    process quantizes, and the results agree bit for bit (the partial sums of the parallel dim are added in float32,
    a + b on both sides)."""
    group = dist.group.WORLD
    torch.manual_seed(11)
    s, b, h_in, h_out = 16, 4, 64, 128  # every shard a multiple of the blocks (MXFP8 32, NVFP4 16)
    full = te.Linear(h_in, h_out)
    tp = te.Linear(h_in, h_out, parallel_mode=mode, tp_group=group, sequence_parallel=True)
    fdist.shard_linear_parameters(tp, full.weight, full.bias)
    column = mode == "column"
    twin = te.Linear(h_in if column else h_in // WORLD, h_out // WORLD if column else h_out, bias=column)
    with torch.no_grad():
        twin.weight.copy_(tp.weight)
        if column:
            twin.bias.copy_(tp.bias)
    gen = torch.Generator().manual_seed(500)  # the same full tensors on every rank
    x, g = torch.randn(s, b, h_in, generator=gen), torch.randn(s, b, h_out, generator=gen)
    seq = slice(RANK * s // WORLD, (RANK + 1) * s // WORLD)
    feat = slice(RANK * h_in // WORLD, (RANK + 1) * h_in // WORLD)
    out = slice(RANK * h_out // WORLD, (RANK + 1) * h_out // WORLD)
    x_in = (x[seq] if column else x[..., feat]).clone().requires_grad_()
    g_in = g[..., out] if column else g[seq]
    with Recorder() as rec:
        rec.active = True
        with te.autocast(recipe=recipe):
            y = tp(x_in)
        fwd = rec.take()
        torch.manual_seed(12)  # NVFP4's stochastic rounding of the gradient: the same draws as the twin's
        y.backward(g_in)
        bwd = rec.take()
    x_twin = (x if column else x[..., feat]).clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y_twin = twin(x_twin)
    torch.manual_seed(12)
    y_twin.backward(g[..., out] if column else g)
    if column:
        dx = x_twin.grad.clone()
        dist.all_reduce(dx)  # the dgrad partial sums of the output shards
        want = [(y, y_twin), (x_in.grad, dx[seq]), (tp.weight.grad, twin.weight.grad), (tp.bias.grad, twin.bias.grad)]
    else:
        y_sum = y_twin.detach().clone()
        dist.all_reduce(y_sum)
        want = [(y, (y_sum + full.bias.detach())[seq]), (x_in.grad, x_twin.grad), (tp.weight.grad, twin.weight.grad)]
        db = g[seq].reshape(-1, h_out).sum(0)
        dist.all_reduce(db)
        want.append((tp.bias.grad, db))
    for i, (got, expect) in enumerate(want):
        assert got.shape == expect.shape and torch.equal(got, expect), \
            (type(recipe).__name__, mode, i, (got - expect).abs().max().item())
    # the sequence all-gather moved float32 values of the full tensor (input forward / gradient backward)
    gathers = _fp8_gathers(fwd if column else bwd)
    full_t = x if column else g
    assert [(e[1], e[2]) for e in gathers] == [(torch.float32, full_t.numel())], [e[:3] for e in gathers]
    assert torch.equal(gathers[0][3].reshape(full_t.shape), full_t)
    if isinstance(recipe, MXFP8BlockScaling):  # shards on 32-boundaries: the full model's blocks, only sums differ
        xf = x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            yf = full(xf)
        torch.manual_seed(12)
        yf.backward(g)
        pairs = [(y, yf[..., out] if column else yf[seq]), (x_in.grad, xf.grad[seq] if column else xf.grad[..., feat]),
                 (tp.weight.grad, full.weight.grad[out] if column else full.weight.grad[:, feat])]
        for got, expect in pairs:
            assert sqnr_db(np32(expect), np32(got)) >= 80, (mode, sqnr_db(np32(expect), np32(got)))
    exact = (x.double() @ full.weight.detach().double().T + full.bias.detach().double())
    exact = exact[..., out] if column else exact[seq]
    assert 8 < sqnr_db(exact.numpy(), np32(y)) < 50, "not a quantized result"  # sanity: FP8 / FP4, not garbage


def check_tp_block_linear():
    for recipe in (MXFP8BlockScaling(), Float8BlockScaling(), NVFP4BlockScaling()):
        for mode in ("column", "row"):
            _block_tp_case(mode, recipe)
