"""Tensor-parallel checks of the attention stack (run by tests/dist_workers.py on 2 gloo ranks): MultiheadAttention and
TransformerLayer with `set_parallel_mode=True`, with and without sequence parallelism, against a single-process module
holding the full weights, in high precision and under both FP8 recipes."""

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

S, B, HID, FFN, H, G = 8, 2, 32, 64, 4, 2
# TransformerLayer adds the row-parallel layers' returned biases to its local tokens
SP_BIASES = ("self_attention.proj.bias", "layernorm_mlp.fc2_bias")


def _shard_from(tp_module, full_module):
    """Copy this rank's share of every full parameter: split along the one dimension where the shapes differ."""
    full = dict(full_module.named_parameters())
    with torch.no_grad():
        for name, p in tp_module.named_parameters():
            f = full[name]
            dims = [d for d in range(f.dim()) if f.shape[d] != p.shape[d]]
            assert len(dims) <= 1, name
            p.copy_(f if not dims else f.chunk(WORLD, dims[0])[RANK])


def _shard_of(full_grad, local_shape):
    dims = [d for d in range(full_grad.dim()) if full_grad.shape[d] != local_shape[d]]
    return full_grad if not dims else full_grad.chunk(WORLD, dims[0])[RANK]


def _compare(make, sp, recipe):
    """Worst SQNR (dB) of the TP module against the single-process one over outputs and gradients (two steps under
    delayed scaling, so that the second casts with the reduced amaxes of the first)."""
    steps = 2 if isinstance(recipe, DelayedScaling) else 1
    torch.manual_seed(21)
    full = make(dict())
    tp = make(dict(set_parallel_mode=True, tp_group=dist.group.WORLD, sequence_parallel=sp))
    _shard_from(tp, full)
    local_recipe = dataclasses.replace(recipe, reduce_amax=False) if isinstance(recipe, DelayedScaling) else recipe
    seq = slice(RANK * S // WORLD, (RANK + 1) * S // WORLD)
    worst, worst_name = 1e9, ""
    for step in range(steps):
        gen = torch.Generator().manual_seed(500 + step)  # the same full tensors on every rank
        x = torch.randn(S, B, HID, generator=gen)
        g = torch.randn(S, B, HID, generator=gen)
        xf, xt = x.clone().requires_grad_(), (x[seq] if sp else x).clone().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=local_recipe):
            yf = full(xf)
        yf.backward(g)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            yt = tp(xt)
        yt.backward(g[seq] if sp else g)
        if sp:  # parameters marked sequence_parallel saw this rank's tokens only: sum over the ranks (Megatron)
            for name, p in tp.named_parameters():
                assert getattr(p, "sequence_parallel", False) == ("layer_norm" in name or name in SP_BIASES), name
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad)
        pairs = [("output", yf[seq] if sp else yf, yt), ("input grad", xf.grad[seq] if sp else xf.grad, xt.grad)]
        full_params = dict(full.named_parameters())
        for name, p in tp.named_parameters():
            if name.endswith("key_bias"):  # softmax ignores q . b_k (the same for every key): its gradient is 0
                scale = float(full_params[name.replace("key", "value")].grad.abs().max())
                assert float(p.grad.abs().max()) <= 1e-3 * scale, (name, p.grad)
                continue
            pairs.append((name, _shard_of(full_params[name].grad, p.shape), p.grad))
        for name, want, got in pairs:
            assert want.shape == got.shape, (name, tuple(want.shape), tuple(got.shape))
            db = sqnr_db(np32(want), np32(got))
            if db < worst:
                worst, worst_name = db, f"{name} (step {step})"
        full.zero_grad()
        tp.zero_grad()
    if isinstance(recipe, DelayedScaling):
        fdist.apply_pending_updates()
        for (name, mf), (_, mt) in zip(full.named_modules(), tp.named_modules()):
            if getattr(mf, "fp8_meta", None) and mf.fp8_meta["scaling_fwd"] is not None:
                for which in ("scaling_fwd", "scaling_bwd"):  # amaxes reduced over TP = the full tensors' amaxes
                    np.testing.assert_allclose(state_np(mt, which)[0], state_np(mf, which)[0], rtol=1e-6,
                                               err_msg=f"{name} {which}")
        assert_same_on_all_ranks([m.fp8_meta[w].scale for m in tp.modules() if getattr(m, "fp8_meta", None)
                                  for w in ("scaling_fwd", "scaling_bwd")], "scales")
    return worst, worst_name


def _mha(extra):
    return te.MultiheadAttention(HID, H, num_gqa_groups=G, input_layernorm=True, attention_dropout=0.0, **extra)


def _layer(extra):
    return te.TransformerLayer(HID, FFN, H, num_gqa_groups=G, hidden_dropout=0.0, attention_dropout=0.0, **extra)


def _check(make, cases):
    for sp, recipe in cases:
        worst, where = _compare(make, sp, recipe)
        name = type(recipe).__name__ if recipe is not None else "high precision"
        # high precision: float32 summation order; FP8: both sides cast the same FP8 bytes, then the same
        assert worst >= (120 if recipe is None else 60), f"{name} sp={sp}: SQNR {worst:.1f} dB at {where}"


DELAYED, CURRENT = DelayedScaling(amax_history_len=3), Float8CurrentScaling()


def check_tp_attention():
    mha = _mha(dict(set_parallel_mode=True, tp_group=dist.group.WORLD))
    assert mha.layernorm_qkv.query_weight.shape == (HID // WORLD, HID)
    assert mha.core_attention.num_attention_heads_per_partition == H // WORLD
    _check(_mha, [(False, None), (True, None), (False, DELAYED), (True, DELAYED), (True, CURRENT)])


def check_tp_transformer_layer():
    if not hasattr(te, "LayerNormMLP"):
        return  # the test file skips this check with its reason
    _check(_layer, [(True, None), (False, DELAYED), (True, DELAYED), (True, CURRENT)])
