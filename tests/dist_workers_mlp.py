"""Tensor-parallel multi-process checks of LayerNormMLP (fc1 column-parallel, fc2 row-parallel) and LayerNormLinear
(column-parallel), with and without sequence parallelism, against a single-process module holding the full weights
(run by tests/dist_workers.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

import fp8kit.pytorch as te
from fp8kit.pytorch import distributed as fdist
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

from dist_common import RANK, WORLD, assert_same_on_all_ranks, state_np
from linear_helpers import np32, sqnr_db

S, B, H, FFN = 8, 2, 32, 64
RECIPES = (DelayedScaling(amax_history_len=4), Float8CurrentScaling())


def _shard(t, dim, parts=1):
    """This rank's block of `t` along `dim`; with parts=2 (a gated fc1), the rank's block of each half."""
    return torch.cat([p.chunk(WORLD, dim)[RANK] for p in t.chunk(parts, dim)], dim)


def _summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _run(module, x, g, recipe):
    xr = x.clone().requires_grad_()
    if recipe is None:
        y = module(xr)
    else:
        with te.autocast(recipe=recipe):
            y = module(xr)
    y.backward(g)
    return y, xr.grad


def _compare(pairs, floor, what):
    for name, got, want in pairs:
        assert got.shape == want.shape, f"{what} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if floor is None:
            assert torch.equal(got, want), f"{what} {name}: not bit-identical"
        else:
            db = sqnr_db(np32(want), np32(got))
            assert db >= floor, f"{what} {name}: SQNR {db:.1f} dB < {floor} dB vs single-process"


def _mlp_case(activation, sp, recipe, steps=3):
    """LayerNormMLP(set_parallel_mode=True) on every rank against the full module on each process."""
    gated = activation in ("swiglu", "geglu")
    torch.manual_seed(11)
    full = te.LayerNormMLP(H, FFN, activation=activation)
    tp = te.LayerNormMLP(H, FFN, activation=activation, set_parallel_mode=True, tp_group=dist.group.WORLD,
                         sequence_parallel=sp)
    assert tp.fc1_weight.shape == ((2 if gated else 1) * FFN // WORLD, H) and tp.fc2_weight.shape == (H, FFN // WORLD)
    with torch.no_grad():
        full.layer_norm_weight.add_(torch.randn(H) * 0.1)
        full.fc1_bias.add_(torch.randn(full.fc1_bias.shape) * 0.1)
        full.fc2_bias.add_(torch.randn(H) * 0.1)
        tp.layer_norm_weight.copy_(full.layer_norm_weight)
        tp.layer_norm_bias.copy_(full.layer_norm_bias)
        tp.fc1_weight.copy_(_shard(full.fc1_weight, 0, 2 if gated else 1))
        tp.fc1_bias.copy_(_shard(full.fc1_bias, 0, 2 if gated else 1))
        tp.fc2_weight.copy_(_shard(full.fc2_weight, 1))
        tp.fc2_bias.copy_(full.fc2_bias)
    local = dataclasses.replace(recipe, reduce_amax=False) if isinstance(recipe, DelayedScaling) else recipe
    seq = slice(RANK * S // WORLD, (RANK + 1) * S // WORLD)
    worst = float("inf")
    for step in range(steps):
        gen = torch.Generator().manual_seed(500 + step)  # the same full tensors on every rank
        x = torch.randn(S, B, H, generator=gen) * (1 + step)
        g = torch.randn(S, B, H, generator=gen) * (1 + 2 * step)
        yf, dxf = _run(full, x, g, local if recipe is not None else None)
        yt, dxt = _run(tp, x[seq] if sp else x, g[seq] if sp else g, recipe)
        ln = [tp.layer_norm_weight.grad, tp.layer_norm_bias.grad]
        if sp:  # each rank's norm saw its part of the sequence: Megatron all-reduces these gradients
            ln = [_summed(t) for t in ln]
        pairs = [("y", yt, yf[seq] if sp else yf), ("dx", dxt, dxf[seq] if sp else dxf),
                 ("d layer_norm_weight", ln[0], full.layer_norm_weight.grad),
                 ("d layer_norm_bias", ln[1], full.layer_norm_bias.grad),
                 ("d fc1_weight", tp.fc1_weight.grad, _shard(full.fc1_weight.grad, 0, 2 if gated else 1)),
                 ("d fc1_bias", tp.fc1_bias.grad, _shard(full.fc1_bias.grad, 0, 2 if gated else 1)),
                 ("d fc2_weight", tp.fc2_weight.grad, _shard(full.fc2_weight.grad, 1)),
                 ("d fc2_bias", tp.fc2_bias.grad, full.fc2_bias.grad)]
        what = f"LayerNormMLP({activation}, sp={sp}, {type(recipe).__name__}) step {step}"
        if recipe is None:
            _compare(pairs, 120, what)
        else:
            for _, got, want in pairs:
                worst = min(worst, sqnr_db(np32(want), np32(got)))
            # both sides cast the same tensors (amaxes reduced over the group): only float32 summation order differs
            _compare(pairs, 80, what)
        if isinstance(recipe, DelayedScaling):
            fdist.apply_pending_updates()
            for w in ("scaling_fwd", "scaling_bwd"):  # amaxes reduced over the group = the full tensors'
                (hf, sf), (ht, st) = state_np(full, w), state_np(tp, w)
                assert np.array_equal(ht, hf) and np.array_equal(st, sf), f"{what} {w}: {ht} != {hf}"
        for m in (full, tp):
            m.zero_grad()
    if isinstance(recipe, DelayedScaling):
        assert_same_on_all_ranks([tp.fp8_meta[w].scale for w in ("scaling_fwd", "scaling_bwd")], "scales")
    if recipe is not None:
        with torch.no_grad():
            y_hp = full(x)  # the last step in high precision
        bias = full.fc2_bias.detach()  # large next to the small initial weights' product: leave it out
        db = sqnr_db(np32((y_hp[seq] if sp else y_hp) - bias), np32(yt - bias))
        assert db < 50, f"the TP output looks high precision ({db:.1f} dB): {activation}, sp={sp}, {recipe}"
    return worst


def check_tp_layernorm_mlp():
    report = {}
    for activation in ("gelu", "swiglu"):
        for sp in (False, True):
            _mlp_case(activation, sp, None, steps=1)
            for recipe in RECIPES:
                report[(activation, sp, type(recipe).__name__)] = _mlp_case(activation, sp, recipe)
    print("LayerNormMLP TP worst SQNR (dB):", {k: round(v, 1) for k, v in report.items()})
    # the norm's output, gathered along the sequence (sequence parallelism), with its gradient reduce-scattered
    torch.manual_seed(13)
    mlp = te.LayerNormMLP(H, FFN, set_parallel_mode=True, tp_group=dist.group.WORLD, sequence_parallel=True,
                          return_layernorm_output=True, return_layernorm_output_gathered=True)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(14))
    seq = slice(RANK * S // WORLD, (RANK + 1) * S // WORLD)
    xr = x[seq].clone().requires_grad_()
    with te.autocast(recipe=RECIPES[1]):
        y, ln_out = mlp(xr)
    want = torch.nn.functional.layer_norm(x, (H,), mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.eps)
    assert y.shape == (S // WORLD, B, H) and torch.equal(ln_out, want)
    assert mlp.layer_norm_weight.sequence_parallel and mlp.layer_norm_bias.sequence_parallel
    ln_out.backward(torch.ones_like(ln_out))  # every rank's use of the gathered output reaches its block
    x_hp = x.clone().requires_grad_()
    torch.nn.functional.layer_norm(x_hp, (H,), mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.eps).backward(
        torch.full((S, B, H), float(WORLD)))
    torch.testing.assert_close(xr.grad, x_hp.grad[seq])
    try:  # delayed scaling without amax reduction cannot share the scale of the FP8 all-gathers
        with te.autocast(recipe=DelayedScaling(reduce_amax=False)):
            mlp(xr)
    except ValueError as e:
        assert "same scale on every tensor-parallel rank" in str(e), str(e)
    else:
        raise AssertionError("no error for sequence parallelism without amax reduction")


def _lnl_case(sp, recipe, steps=3):
    torch.manual_seed(12)
    full = te.LayerNormLinear(H, FFN)
    tp = te.LayerNormLinear(H, FFN, parallel_mode="column", tp_group=dist.group.WORLD, sequence_parallel=sp)
    with torch.no_grad():
        full.layer_norm_weight.add_(torch.randn(H) * 0.1)
        full.bias.add_(torch.randn(FFN) * 0.1)
        tp.layer_norm_weight.copy_(full.layer_norm_weight)
        tp.layer_norm_bias.copy_(full.layer_norm_bias)
        tp.weight.copy_(_shard(full.weight, 0))
        tp.bias.copy_(_shard(full.bias, 0))
    local = dataclasses.replace(recipe, reduce_amax=False) if isinstance(recipe, DelayedScaling) else recipe
    seq = slice(RANK * S // WORLD, (RANK + 1) * S // WORLD)
    out = slice(RANK * FFN // WORLD, (RANK + 1) * FFN // WORLD)
    for step in range(steps):
        gen = torch.Generator().manual_seed(600 + step)
        x = torch.randn(S, B, H, generator=gen) * (1 + step)
        g = torch.randn(S, B, FFN, generator=gen) * (1 + 2 * step)
        yf, dxf = _run(full, x, g, local)
        yt, dxt = _run(tp, x[seq] if sp else x, g[..., out], recipe)
        ln = [tp.layer_norm_weight.grad, tp.layer_norm_bias.grad]
        if sp:
            ln = [_summed(t) for t in ln]
        # column parallel: the output's shards are the full output's columns, cast from the same FP8 bytes
        what = f"LayerNormLinear(column, sp={sp}, {type(recipe).__name__}) step {step}"
        _compare([("y", yt, yf[..., out]), ("d weight", tp.weight.grad, _shard(full.weight.grad, 0)),
                  ("d bias", tp.bias.grad, _shard(full.bias.grad, 0))], 80, what)
        _compare([("dx", dxt, dxf[seq] if sp else dxf), ("d layer_norm_weight", ln[0], full.layer_norm_weight.grad),
                  ("d layer_norm_bias", ln[1], full.layer_norm_bias.grad)], 80, what)
        if isinstance(recipe, DelayedScaling):
            fdist.apply_pending_updates()
            for w in ("scaling_fwd", "scaling_bwd"):
                (hf, sf), (ht, st) = state_np(full, w), state_np(tp, w)
                assert np.array_equal(ht, hf) and np.array_equal(sf, st), f"{what} {w}: {ht} != {hf}"
        for m in (full, tp):
            m.zero_grad()


def check_tp_layernorm_linear():
    for sp in (False, True):
        for recipe in RECIPES:
            _lnl_case(sp, recipe)
