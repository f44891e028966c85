"""Multi-process checks of FSDP2 (fully_shard) with FP8 weights (quantized_model_init), run by tests/dist_workers.py
for tests/test_fsdp_fp8.py on 2 gloo ranks.

Compared against: the same model with bf16 weights under FSDP2 (its all-gather bytes, its losses), the same bf16 model
without FP8 compute (the size of FP8 noise), the per-unit byte counts computed from the parameter shapes, raw
torch.distributed gathers of every rank's shard, a single-process copy of the model holding the gathered weights, and
an uninterrupted run (checkpoints)."""

from __future__ import annotations

import gc
import io
import math
import shutil
import tempfile
import warnings

import numpy as np
import torch
import torch.distributed as dist

import fp8kit.pytorch as te
from fp8kit.pytorch import distributed as fdist
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref
from dist_common import E4M3, RANK, WORLD, all_rows, assert_same_on_all_ranks

SIZES = [(64, 96), (96, 33), (33, 64)]  # 33 rows: uneven sharding on 2 ranks (17 + 16, padded to 17)
DTYPE = torch.bfloat16


class WireRecorder:
    """Wraps the all-gather collectives FSDP2 calls and records (dtype, bytes sent by this rank) while `active`."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.events, self.active, self.saved = [], False, {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapper(*args, _fn=fn, **kwargs):
                if self.active:
                    inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
                    self.events.append((inp.dtype, inp.numel() * inp.element_size()))
                return _fn(*args, **kwargs)
            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def take(self):
        events, self.events = self.events, []
        return events


def _fresh_start():
    """Collect the models of earlier checks on every rank now: FSDP2 modules live in reference cycles, and a dead
    module still registered under a delayed-scaling key on one rank only would break the amax reduction's rule that
    all ranks register the same modules (collection times differ between processes)."""
    gc.collect()


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _build(recipe, fp8: bool, seed: int = 0, mesh=None, shard: bool = True):
    """The MLP (bf16 parameters; FP8 weights when `fp8`), sharded by fully_shard per Linear (unless `shard` is
    False: the whole model on every rank), and a FusedAdam with float32 masters seeded from the high-precision initial
    weights (so both kinds of run start from equal masters)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    with te.quantized_model_init(enabled=fp8, recipe=recipe, preserve_high_precision_init_val=True):
        layers = [te.Linear(i, o, params_dtype=DTYPE) for i, o in SIZES]
    model = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1], torch.nn.GELU(), layers[2])
    init = {n: p.get_high_precision_init_val() for n, p in model.named_parameters() if isinstance(p, te.Float8Tensor)}
    if shard:
        mesh = mesh or _mesh()
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = te.optimizers.FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01, master_weights=True)
    for name, p in model.named_parameters():
        if name in init:  # Transformer Engine's way (its fully_shard example): this rank's rows of the initial value
            opt.set_scaled_state(p, "master_param", torch.chunk(init[name], WORLD)[RANK] if shard else init[name])
    return model, opt


def _batches(seed, steps):
    gen = torch.Generator().manual_seed(seed + RANK)  # different data on every rank
    return [(torch.randn(16, 64, generator=gen).to(DTYPE), torch.randn(16, 64, generator=gen)) for _ in range(steps)]


def _train(model, opt, recipe, batches, fp8_compute=True, rec=None):
    """Steps on this rank's batches; returns the losses averaged over the ranks and the all-gather events per step."""
    losses, events = [], []
    for x, target in batches:
        if rec is not None:
            rec.active = True
        with te.autocast(enabled=fp8_compute, recipe=recipe):
            loss = (model(x).float() - target).square().mean()
        loss.backward()
        if rec is not None:
            rec.active = False
            events.append(rec.take())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    return np.array(losses), events


def _unit_bytes(fp8: bool):
    """What one rank sends when FSDP2 gathers each Linear: its padded shard of the weight (1 byte per element as FP8,
    2 as bf16) and of the bias (2 bytes)."""
    out = []
    for i, o in SIZES:
        rows = math.ceil(o / WORLD)
        out.append(rows * i * (1 if fp8 else 2) + rows * 2)
    return out


def _shard(p):
    return p._local_tensor


def _fp8_bytes(t) -> torch.Tensor:
    return t._data.contiguous().view(torch.uint8)


def _run_fsdp8(recipe):
    steps = 5
    batches = _batches(50, 1) * steps  # one batch per rank, fitted: the loss must go down
    runs = {}
    with WireRecorder() as rec:
        for kind in ("fp8", "bf16"):
            model, opt = _build(recipe, kind == "fp8")
            runs[kind] = (model,) + _train(model, opt, recipe, batches, rec=rec)
    hp_model, hp_opt = _build(recipe, False)
    hp_losses, _ = _train(hp_model, hp_opt, recipe, batches, fp8_compute=False)

    # the wire: FP8 bytes (uint8 views) against bf16, per gather equal to what the shapes say
    (model, fp8_losses, fp8_events), (_, bf16_losses, bf16_events) = runs["fp8"], runs["bf16"]
    for step in range(steps):
        fp8_step, bf16_step = fp8_events[step], bf16_events[step]
        assert fp8_step and len(fp8_step) == len(bf16_step), (fp8_step, bf16_step)
        assert {d for d, _ in fp8_step} == {torch.uint8} and {d for d, _ in bf16_step} == {DTYPE}
        assert sorted({b for _, b in fp8_step}) == sorted(set(_unit_bytes(True))), fp8_step
        assert sorted({b for _, b in bf16_step}) == sorted(set(_unit_bytes(False))), bf16_step
    fp8_total = sum(b for step in fp8_events for _, b in step)
    bf16_total = sum(b for step in bf16_events for _, b in step)
    ratio = fp8_total / bf16_total
    assert 0.5 <= ratio <= 0.52, ratio
    print(f"FSDP2 all-gather bytes per rank, {steps} steps: FP8 weights {fp8_total}, bf16 weights {bf16_total}, "
          f"ratio {ratio:.4f}", flush=True)

    # the losses: FP8 weights against bf16 weights (both FP8 compute) well within the FP8 noise (FP8 against bf16
    # compute), and the step-0 forward identical (the FP8 weights are the cast of the bf16 initial weights)
    gap = np.abs(fp8_losses - bf16_losses)
    noise = np.abs(bf16_losses - hp_losses)
    assert gap[0] == 0, gap
    assert gap.mean() <= 0.5 * noise.mean() and noise.mean() > 0, (fp8_losses, bf16_losses, hp_losses)
    assert fp8_losses[-1] < fp8_losses[0], fp8_losses
    print(f"losses: FP8 weights {fp8_losses.round(6).tolist()}, bf16 weights {bf16_losses.round(6).tolist()}, "
          f"mean |gap| {gap.mean():.2e}, FP8 noise {noise.mean():.2e}", flush=True)
    return model


def _gathered_weights(model, x):
    """The weights the Linears receive in a forward (the gathered Float8Tensors) and the output."""
    seen = []
    # a copy: FSDP2 frees the gathered bytes after the forward
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.detach().clone()))
             for m in model if isinstance(m, te.Linear)]
    with torch.no_grad():
        out = model(x)
    for h in hooks:
        h.remove()
    return seen, out


def _check_gathered(model, recipe):
    """Every rank gathers the same bytes and scale, which are every rank's shard bytes in order, read with the one
    scale all shards share; a single-process model holding those weights computes the same output."""
    x = _batches(90, 1)[0][0]
    with te.autocast(recipe=recipe):
        seen, out = _gathered_weights(model, x)
    linears = [m for m in model if isinstance(m, te.Linear)]
    assert len(seen) == 3 and all(isinstance(w, te.Float8Tensor) and w.shape == (o, i)
                                  for w, (i, o) in zip(seen, SIZES))
    assert_same_on_all_ranks([_fp8_bytes(w) for w in seen] + [w._scale_inv for w in seen], "gathered FP8 weights")
    for layer, w in zip(linears, seen):
        shard = _shard(layer.weight)
        assert_same_on_all_ranks([shard._scale_inv], "shard scale_inv")
        assert torch.equal(shard._scale_inv, w._scale_inv)
        rows = math.ceil(w.shape[0] / WORLD)
        mine = _fp8_bytes(w)[RANK * rows: RANK * rows + shard.shape[0]]
        assert torch.equal(mine, _fp8_bytes(shard)), "the gathered rows differ from this rank's shard"
    if isinstance(recipe, Float8CurrentScaling):  # no state: the same weights give the same output in one process
        single = [te.Linear(i, o, params_dtype=DTYPE) for i, o in SIZES]
        for dst, src, w in zip(single, linears, seen):
            dst.weight = torch.nn.Parameter(w)
            dst.bias = torch.nn.Parameter(src.bias.full_tensor())
        with torch.no_grad(), te.autocast(recipe=recipe):
            want = torch.nn.Sequential(single[0], torch.nn.GELU(), single[1], torch.nn.GELU(), single[2])(x)
        assert torch.equal(out, want)


def check_fsdp8_current():
    _fresh_start()
    recipe = Float8CurrentScaling()
    model = _run_fsdp8(recipe)
    _check_gathered(model, recipe)


def check_fsdp8_delayed():
    _fresh_start()
    recipe = DelayedScaling(amax_history_len=4)
    model = _run_fsdp8(recipe)
    _check_gathered(model, recipe)
    states = [m.fp8_meta[k].scale for m in model if isinstance(m, te.Linear) for k in ("scaling_fwd", "scaling_bwd")]
    assert_same_on_all_ranks(states, "delayed-scaling scales")


def _delayed_states(model) -> list:
    """Copies of every Linear's delayed-scaling state: forward and backward amax history and scale."""
    return [t.clone() for m in model if isinstance(m, te.Linear) for k in ("scaling_fwd", "scaling_bwd")
            for t in (m.fp8_meta[k].amax_history, m.fp8_meta[k].scale)]


def check_fsdp8_delayed_state():
    """Delayed scaling, FP8 weights: the FSDP2 model (2 ranks, one layer sharded unevenly) against the same model
    unsharded on each rank, both fed the same batch on every rank: losses, weight bytes and scales, and every
    Linear's delayed-scaling state (forward and backward amax history and scale) bit for bit, each model's state read
    right after its own training. The weight slot stages the amax of the optimizer's requantization (of the whole
    weight: the shards' amaxes all-reduced) and the next forward update rolls it in, as without FSDP.

    Then the rule that makes "right after its own training" necessary (Transformer Engine's too): a model that has
    stopped running stays registered under its key and takes part in every update of that key. When the unsharded
    model trained, the FSDP2 model's weight slot rolled in the amax staged by its last optimizer step at the first
    update, and nothing after (its other slots had nothing staged): its history is one roll ahead of the state it
    stopped with (tests/reference.py's DelayedState, fed that state, gives it)."""
    _fresh_start()
    recipe = DelayedScaling(amax_history_len=4)
    gen = torch.Generator().manual_seed(70)  # the same data on every rank: the gradient is every rank's
    batches = [(torch.randn(16, 64, generator=gen).to(DTYPE), torch.randn(16, 64, generator=gen))] * 6
    sharded, sharded_opt = _build(recipe, True)
    sharded_losses, _ = _train(sharded, sharded_opt, recipe, batches)
    fdist.apply_pending_updates()  # the deferred backward update of the last step
    sharded_states = _delayed_states(sharded)
    plain, plain_opt = _build(recipe, True, shard=False)
    plain_losses, _ = _train(plain, plain_opt, recipe, batches)
    fdist.apply_pending_updates()
    plain_states = _delayed_states(plain)

    assert np.array_equal(sharded_losses, plain_losses), (sharded_losses, plain_losses)
    assert sharded_losses[-1] < sharded_losses[0], sharded_losses
    linears = [(a, b) for a, b in zip(sharded, plain) if isinstance(a, te.Linear)]
    for a, b in linears:  # this rank's shard holds its rows of the unsharded weight, with the same scale
        shard = _shard(a.weight)
        rows = math.ceil(b.weight.shape[0] / WORLD)
        assert torch.equal(_fp8_bytes(shard), _fp8_bytes(b.weight)[RANK * rows: RANK * rows + shard.shape[0]])
        assert torch.equal(shard._scale_inv, b.weight._scale_inv)
    names = [f"linear{i}.{k}.{t}" for i in range(3) for k in ("fwd", "bwd") for t in ("amax_history", "scale")]
    for name, a, b in zip(names, sharded_states, plain_states):
        assert torch.equal(a, b), (name, a, b)
    assert all(float(h[0, 1]) > 0 for h in sharded_states[0::4]), "the last optimizer step staged no weight amax"

    # the idle FSDP2 model's state after the unsharded model's training: one more forward update
    for i, (a, _) in enumerate(linears):
        fwd = ref.DelayedState(4, 3, E4M3)
        fwd.history[:] = sharded_states[4 * i].numpy()
        fwd.scale[:] = sharded_states[4 * i + 1].numpy()
        fwd.update()
        state = a.fp8_meta["scaling_fwd"]
        assert np.array_equal(state.amax_history.numpy(), fwd.history), (i, state.amax_history, fwd.history)
        assert np.array_equal(state.scale.numpy(), fwd.scale), (i, state.scale, fwd.scale)
        assert torch.equal(a.fp8_meta["scaling_bwd"].amax_history, sharded_states[4 * i + 2])
    assert_same_on_all_ranks(sharded_states + plain_states, "delayed-scaling states")


def check_fsdp8_state_dict():
    _fresh_start()
    _state_dict_round_trip(DelayedScaling(amax_history_len=4))


def check_fsdp8_state_dict_current():
    _fresh_start()
    _state_dict_round_trip(Float8CurrentScaling())


def _state_dict_round_trip(recipe):
    """model.state_dict() + FusedAdam.state_dict() through torch.save, and through torch.distributed.checkpoint,
    into freshly built FSDP2 models (other initial weights) resume exactly like the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    mesh = _mesh()
    model, opt = _build(recipe, True, mesh=mesh)
    _train(model, opt, recipe, _batches(60, 2))
    fdist.apply_pending_updates()  # the deferred backward update of the last step, before saving
    assert all(isinstance(v, DTensor) for v in opt.state_dict()["state"][0].values())  # sharded, for DCP
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    ckpt = [tempfile.mkdtemp(prefix="fp8kit_dcp_") if RANK == 0 else None]
    dist.broadcast_object_list(ckpt)
    dcp.save({"model": model.state_dict(), "opt": opt.state_dict()}, checkpoint_id=ckpt[0])
    at_save = [_shard(p).detach().clone() for p in model.parameters()]
    batches = _batches(80, 2)
    want, _ = _train(model, opt, recipe, batches)
    want_params = [_shard(p).detach().clone() for p in model.parameters()]
    want_states = [{k: v.to_local().clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    for source in ("torch.save", "dcp"):
        other, other_opt = _build(recipe, True, seed=7, mesh=mesh)
        if source == "torch.save":
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
        else:  # DCP loads into the given structure: every state must exist (as in Transformer Engine's example)
            for p in other.parameters():
                if not other_opt.state[p]:
                    other_opt.initialize_state(p)
            saved = {"model": other.state_dict(), "opt": other_opt.state_dict()}
            dcp.load(saved, checkpoint_id=ckpt[0])
        other.load_state_dict(saved["model"])
        other_opt.load_state_dict(saved["opt"])
        _assert_same_shards(at_save, other, source + " load")
        got, _ = _train(other, other_opt, recipe, batches)
        assert np.array_equal(got, want), (source, got, want)
        _assert_same_shards(want_params, other, source)
        for (name, p), states in zip(other.named_parameters(), want_states):
            for key, value in states.items():
                assert torch.equal(value, other_opt.state[p][key].to_local()), (source, name, key)
        del other, other_opt, saved
        _fresh_start()
    dist.barrier()
    if RANK == 0:
        shutil.rmtree(ckpt[0], ignore_errors=True)


def _assert_same_shards(want, model, what):
    for (name, p), a in zip(model.named_parameters(), want):
        b = _shard(p)
        if isinstance(a, te.Float8Tensor):
            assert isinstance(b, te.Float8Tensor), (what, name)
            assert torch.equal(_fp8_bytes(a), _fp8_bytes(b)) and torch.equal(a._scale_inv, b._scale_inv), (what, name)
        else:
            assert torch.equal(a, b), (what, name)


def check_fsdp8_different_init():
    """Ranks that build different initial weights (no common seed) hold shards quantized with different scales: the
    first all-gather puts them on the largest scale_inv (with a warning), and the gathered weight holds every rank's
    shard values within that requantization's rounding."""
    _fresh_start()
    recipe = Float8CurrentScaling()
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(100 + RANK)
    with te.quantized_model_init(recipe=recipe):
        layer = te.Linear(32, 64, params_dtype=DTYPE)
    fully_shard(layer, mesh=_mesh())
    shard = _shard(layer.weight)
    before = shard.dequantize(dtype=torch.float32)
    invs = all_rows(shard._scale_inv.numpy())[:, 0]
    assert invs[0] != invs[1], "expected different scales"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with te.autocast(recipe=recipe):
            seen, _ = _gathered_weights(torch.nn.Sequential(layer), torch.randn(4, 32).to(DTYPE))
    assert any("different scales on different ranks" in str(w.message) for w in caught)
    assert_same_on_all_ranks([shard._scale_inv, seen[0]._scale_inv, _fp8_bytes(seen[0])], "harmonised weight")
    after = shard.dequantize(dtype=torch.float32)
    inv = shard._scale_inv.item()
    # requantized on a grid no finer than before: within half an FP8 step (E4M3: 3 mantissa bits) of the old values
    assert torch.all((after - before).abs() <= before.abs() * 2.0 ** -4 + inv * 2.0 ** -9 * 0.5 + 1e-30)
