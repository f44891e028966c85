"""Multi-process checks of fp8kit.pytorch on torch.distributed (gloo, CPU); tests/dist_launch.py starts this file
once per rank with the names of the checks to run, in order.

Each check compares fp8kit against something it does not share code with: tests/reference.py fed with amaxes
computed by the reference from the tensors themselves and max-reduced with raw torch.distributed calls, a
single-process model holding the full weights, or float64.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.pytorch import distributed as fdist  # noqa: E402
from fp8kit.recipe import DelayedScaling  # noqa: E402

import reference as ref  # noqa: E402
from dist_common import (  # noqa: E402
    E4M3,
    E5M2,
    RANK,
    WORLD,
    Recorder,
    RefModule,
    assert_same_on_all_ranks,
    assert_state_equals_ref,
    global_max,
    names,
    reduce_over_ranks,
    state_np,
)
from dist_workers_attn import check_tp_attention, check_tp_transformer_layer  # noqa: E402, F401
from dist_workers_fsdp8 import (  # noqa: E402, F401
    check_fsdp8_current,
    check_fsdp8_delayed,
    check_fsdp8_delayed_state,
    check_fsdp8_different_init,
    check_fsdp8_state_dict,
    check_fsdp8_state_dict_current,
)
from dist_workers_mlp import check_tp_layernorm_linear, check_tp_layernorm_mlp  # noqa: E402, F401
from dist_workers_rules import (  # noqa: E402, F401
    check_rule_caught_exception,
    check_rule_different_groups,
    check_rule_different_reduce_amax,
    check_rule_no_grad_step,
    check_rule_peer_stops,
    check_rule_slow_rank_is_fine,
)
from dist_workers_tp import (  # noqa: E402, F401
    check_tp_block_linear,
    check_tp_dp_4_ranks,
    check_tp_linear,
    check_tp_mlp_bf16,
)
from linear_helpers import np32, sqnr_db  # noqa: E402

# ---- check: amax reduction equals the reference, one all-reduce per key and update ------------------------------

def check_amax_reduction():
    recipe = DelayedScaling(amax_history_len=4, margin=1)
    torch.manual_seed(0)  # the same weights on every rank
    l1, l2 = te.Linear(16, 32), te.Linear(32, 16)
    refs = [RefModule(4, margin=1), RefModule(4, margin=1)]
    gen = torch.Generator().manual_seed(100 + RANK)  # different data on every rank
    with Recorder() as rec:
        for step in range(5):
            x = torch.randn(8, 16, generator=gen) * (1 + step + 3 * RANK)
            g = torch.randn(8, 16, generator=gen) * (2 + RANK)
            captured = {}
            rec.active = True
            with te.autocast(recipe=recipe):
                entry = rec.take()
                if step > 0:  # the deferred backward update of the previous step ran at this entry
                    for layer, r in zip((l1, l2), refs):
                        assert_state_equals_ref(layer, "scaling_bwd", r.bwd, f"step {step} entry")
                y1 = l1(x)
                h = torch.relu(y1)
                y2 = l2(h)
                body = rec.take()
            exit_ = rec.take()
            rec.active = False
            y1.register_hook(lambda d: captured.__setitem__("dy1", d))
            y2.register_hook(lambda d: captured.__setitem__("dy2", d))
            # collectives: none in the body; one all-reduce per key at the exit and at the next entry, except
            # when registration changed (the first update of each pass adds the fingerprint exchange)
            assert body == [], f"collectives inside the autocast body: {names(body)}"
            if step == 0:
                assert names(exit_) == ["all_reduce", "all_gather", "all_gather", "all_reduce"], names(exit_)
                assert entry == []
            else:
                assert names(exit_) == ["all_reduce"] and exit_[0][2] == 6 + 6, exit_
                want = ["all_reduce", "all_gather", "all_gather", "all_reduce"] if step == 1 else ["all_reduce"]
                assert names(entry) == want, names(entry)
                assert entry[-1][2] == (6 if step > 1 else 0) + 4, entry[-1][2]
            # the reference, fed with the amaxes of the tensors themselves, max-reduced over the ranks
            for r, inp, layer in ((refs[0], x, l1), (refs[1], h, l2)):
                r.fwd.record(0, ref.amax(np32(inp)))
                r.fwd.record(1, ref.amax(np32(layer.weight)))
                r.fwd.update(reduce=reduce_over_ranks)
            for layer, r in zip((l1, l2), refs):
                assert_state_equals_ref(layer, "scaling_fwd", r.fwd, f"step {step} exit")
            (y2 * g).sum().backward()
            refs[0].bwd.record(0, ref.amax(np32(captured["dy1"])))
            refs[1].bwd.record(0, ref.amax(np32(captured["dy2"])))
            for r in refs:
                r.bwd.update(reduce=reduce_over_ranks)
            # backward states: this rank's amax staged, not reduced or rolled yet (that is collective, at the
            # next outermost entry)
            assert np32(l2.fp8_meta["scaling_bwd"].amax_history)[0, 0] == ref.amax(np32(captured["dy2"]))
    fdist.apply_pending_updates()
    for layer, r in zip((l1, l2), refs):
        assert_state_equals_ref(layer, "scaling_bwd", r.bwd, "after apply_pending_updates")
    assert refs[0].fwd.scale[0] != 1 and refs[1].bwd.scale[0] != 1  # the scales really moved
    assert_same_on_all_ranks([l1.fp8_meta["scaling_fwd"].amax_history, l2.fp8_meta["scaling_bwd"].scale],
                             "states")


# ---- check: modules skipped on some ranks (MoE experts without tokens) ------------------------------------------

def check_moe_skip():
    recipe = DelayedScaling(amax_history_len=3)
    torch.manual_seed(1)
    shared = te.Linear(16, 16)
    experts = [te.Linear(16, 16) for _ in range(3)]
    mods = [shared] + experts
    refs = [RefModule(3) for _ in mods]
    # which experts each rank runs per step (the shared layer runs unless the rank has no tokens at all)
    plan = [
        {0: [0, 1, 2], 1: [0, 1, 2]},  # step 0: every module on every rank (registration; rank 1 gives
                                       # expert 2 an empty input, as docs/distributed.md suggests)
        {0: [0, 1, 2], 1: [0, 1]},     # expert 2 only on rank 0: it rolls on both ranks
        {0: [1], 1: [0]},              # expert 2 on no rank: it keeps history and scale everywhere
        {0: [2], 1: None},             # rank 1 has no tokens: it runs no FP8 module, forward or backward
        {0: [0, 1, 2], 1: [0, 1, 2]},
    ]
    gen = torch.Generator().manual_seed(200 + RANK)
    for step, runs in enumerate(plan):
        mine = runs[RANK % 2] if RANK < 2 else [0, 1, 2]
        x = torch.randn(4, 16, generator=gen) * (1 + RANK + step)
        grads = [torch.randn(4, 16, generator=gen) * (i + 1) for i in range(4)]
        outs, captured = [], {}
        with te.autocast(recipe=recipe):
            if step > 0:
                for mod, r in zip(mods, refs):
                    assert_state_equals_ref(mod, "scaling_bwd", r.bwd, f"step {step} entry")
            before = [state_np(experts[2], w) for w in ("scaling_fwd", "scaling_bwd")] if step == 2 else None
            used = []
            if mine is not None:
                h = shared(x)
                used.append((0, x))
                for e in mine:
                    tokens = h[:0] if (step == 0 and RANK == 1 and e == 2) else h
                    outs.append((e + 1, experts[e](tokens)))
                    used.append((e + 1, tokens))
        for i, r in enumerate(refs):
            if any(j == i for j, _ in used):
                inp = next(t for j, t in used if j == i)
                r.fwd.record(0, ref.amax(np32(inp)))
                r.fwd.record(1, ref.amax(np32(mods[i].weight)))
            r.fwd.update(reduce=reduce_over_ranks)
            assert_state_equals_ref(mods[i], "scaling_fwd", r.fwd, f"step {step} module {i}")
        if outs:
            for i, y in outs:
                y.register_hook(lambda d, i=i: captured.__setitem__(i, captured.get(i, 0) + d))
            h.register_hook(lambda d: captured.__setitem__(0, d))
            sum((y * grads[i][:y.shape[0]]).sum() for i, y in outs).backward()
        for i, r in enumerate(refs):
            if i in captured:
                r.bwd.record(0, ref.amax(np32(captured[i])))
            r.bwd.update(reduce=reduce_over_ranks)
        if step == 2:
            with te.autocast(recipe=recipe):  # runs the deferred backward update; nothing else
                pass
            after = [state_np(experts[2], w) for w in ("scaling_fwd", "scaling_bwd")]
            for (h0, s0), (h1, s1) in zip(before, after):  # expert 2 ran on no rank: untouched
                assert np.array_equal(h0, h1) and np.array_equal(s0, s1), "an expert no rank ran changed"
    fdist.apply_pending_updates()
    for i, (mod, r) in enumerate(zip(mods, refs)):
        assert_state_equals_ref(mod, "scaling_bwd", r.bwd, f"final module {i}")
    assert_same_on_all_ranks([m.fp8_meta[w].amax_history for m in mods for w in ("scaling_fwd", "scaling_bwd")],
                             "histories")


def current_amax(history):
    """A callable amax_compute_algo (works on torch and NumPy): with a callable every update rolls, so an update
    that should not happen is visible."""
    return history[0] * 1


def check_unused_key_keeps_state():
    """A nested recipe whose module runs on some ranks, one rank, or none: the key updates (and, with a callable
    algorithm, rolls) only in steps where some rank ran it; `update_count` counts exactly those steps."""
    outer = DelayedScaling(amax_history_len=3)
    inner = DelayedScaling(amax_history_len=3, amax_compute_algo=current_amax)
    torch.manual_seed(2)
    always, rare = te.Linear(16, 16), te.Linear(16, 16)
    r_always = RefModule(3)
    r_rare = RefModule(3)
    r_rare.fwd = ref.DelayedState(3, 3, E4M3, algo=current_amax)
    r_rare.bwd = ref.DelayedState(3, 2, E5M2, algo=current_amax)
    who_runs_rare = [set(range(WORLD)), set(), {0}, set(), {1}, set()]
    gen = torch.Generator().manual_seed(250 + RANK)
    for step, who in enumerate(who_runs_rare):
        x = torch.randn(4, 16, generator=gen) * (1 + RANK + step)
        g = torch.randn(4, 16, generator=gen)
        captured = {}
        with te.autocast(recipe=outer):
            y = always(x)
            ya = y
            with te.autocast(recipe=inner):  # entered on every rank, also where `rare` does not run
                if RANK in who:
                    y = rare(ya)
        r_always.fwd.record(0, ref.amax(np32(x)))
        r_always.fwd.record(1, ref.amax(np32(always.weight)))
        r_always.fwd.update(reduce=reduce_over_ranks)
        if RANK in who:
            r_rare.fwd.record(0, ref.amax(np32(ya)))
            r_rare.fwd.record(1, ref.amax(np32(rare.weight)))
        if who:
            r_rare.fwd.update(reduce=reduce_over_ranks)
        assert_state_equals_ref(always, "scaling_fwd", r_always.fwd, f"step {step} always")
        assert_state_equals_ref(rare, "scaling_fwd", r_rare.fwd, f"step {step} rare")
        ya.register_hook(lambda d: captured.__setitem__("a", d))
        if y is not ya:
            y.register_hook(lambda d: captured.__setitem__("r", d))
        (y * g).sum().backward()
        r_always.bwd.record(0, ref.amax(np32(captured["a"])))
        r_always.bwd.update(reduce=reduce_over_ranks)
        if "r" in captured:
            r_rare.bwd.record(0, ref.amax(np32(captured["r"])))
        if who:
            r_rare.bwd.update(reduce=reduce_over_ranks)
    fdist.apply_pending_updates()
    assert_state_equals_ref(always, "scaling_bwd", r_always.bwd, "final always")
    assert_state_equals_ref(rare, "scaling_bwd", r_rare.bwd, "final rare")
    steps_with_rare = sum(1 for who in who_runs_rare if who)
    assert rare.fp8_meta["scaling_fwd"].update_count == rare.fp8_meta["scaling_bwd"].update_count == steps_with_rare
    assert always.fp8_meta["scaling_fwd"].update_count == len(who_runs_rare)


# ---- check: registration mismatches raise a clear error on every rank, quickly ----------------------------------

def _expect_mismatch(run_steps, *needles):
    start = time.time()
    try:
        run_steps()
    except fdist.RegistrationMismatchError as e:
        message = str(e)
    else:
        raise AssertionError("no RegistrationMismatchError")
    assert time.time() - start < 10, f"the error took {time.time() - start:.1f} s"
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    return message


def check_registration_mismatch():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(RANK))

    # 1. a different number of modules: rank 1 skips a module in the first step
    recipe = DelayedScaling(amax_history_len=5)
    a, b = te.Linear(16, 16), te.Linear(16, 32)

    def fewer():
        with te.autocast(recipe=recipe):
            a(x)
            if RANK == 0:
                b(x)
    _expect_mismatch(fewer, "rank 0 has 2 modules, rank 1 has 1", "position 1",
                     "Linear(in_features=16, out_features=32, bias=True) [3 slots, history 5]", "rank 1 has nothing")

    # 2. the same count, different shapes at one position
    recipe = DelayedScaling(amax_history_len=6)
    c = te.Linear(16, 16)
    d = te.Linear(16, 32) if RANK == 0 else te.Linear(16, 48)

    def shapes():
        with te.autocast(recipe=recipe):
            c(x)
            d(x)
    _expect_mismatch(shapes, "position 1", "out_features=32", "out_features=48")

    # 3. the same modules in a different order
    recipe = DelayedScaling(amax_history_len=7)
    e, f = te.Linear(16, 16, bias=False), te.Linear(16, 64)

    def order():
        with te.autocast(recipe=recipe):
            for m in ((e, f) if RANK == 0 else (f, e)):
                m(x)
    _expect_mismatch(order, "position 0", "bias=False", "out_features=64")

    # 4. a late registration: rank 1 runs a new module in the third step (a key of its own: the DDP and FSDP2
    # checks' modules, kept alive by reference cycles until a collection, are registered under history 8)
    recipe = DelayedScaling(amax_history_len=17)
    g, h, late = te.Linear(16, 16), te.Linear(16, 16), te.Linear(16, 16)

    def steps():
        for step in range(3):
            with te.autocast(recipe=recipe):
                y = h(g(x.clone().requires_grad_()))
                if step == 2 and RANK == 1:
                    y = late(y)
            y.sum().backward()
    _expect_mismatch(steps, "rank 0 has 2 modules, rank 1 has 3", "position 2")

    # 5. ranks in different autocast keys (different recipes): caught by the key hash, not mixed
    keyed = te.Linear(16, 16)

    def recipes():
        with te.autocast(recipe=DelayedScaling(amax_history_len=9, margin=RANK)):
            keyed(x)
    _expect_mismatch(recipes, "different autocast keys")

    # after all that, a well-formed step under a fresh key still works on every rank
    recipe = DelayedScaling(amax_history_len=10)
    with te.autocast(recipe=recipe):
        keyed(x * (RANK + 1))
    assert keyed.fp8_meta["scaling_fwd"].amax_history[-1, 0] == global_max([ref.amax(np32(x * (RANK + 1)))])[0]


# ---- check: DistributedDataParallel ----------------------------------------------------------------------------

def _mlp(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(te.Linear(32, 64), torch.nn.ReLU(), te.Linear(64, 32))
    for layer in (model[0], model[2]):  # torch.nn.Linear's initialisation (the thresholds below assume it)
        torch.nn.Linear.reset_parameters(layer)
    return model


def _train_with_single_process_twin(model, single, recipe, local_recipe, steps: int, seed: int) -> None:
    """SGD steps of the distributed `model` on this rank's batch and of `single` on every rank's batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.1)
    for step in range(steps):
        batches = [torch.randn(8, 32, generator=torch.Generator().manual_seed(seed + 10 * step + r)) * (1 + r)
                   for r in range(WORLD)]
        with te.autocast(recipe=recipe):
            loss = model(batches[RANK]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with te.autocast(recipe=local_recipe):
            loss_single = single(torch.cat(batches)).square().mean()
        loss_single.backward()
        opt_single.step()
        opt_single.zero_grad()
    fdist.apply_pending_updates()


def check_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP

    recipe = DelayedScaling(amax_history_len=8)
    model = DDP(_mlp(11))
    single = _mlp(11)  # the same model on one process, fed with every rank's batch
    start = [p.detach().clone() for p in single.parameters()]
    local_recipe = DelayedScaling(amax_history_len=8, reduce_amax=False)
    _train_with_single_process_twin(model, single, recipe, local_recipe, steps=4, seed=500)
    inner = model.module
    states = [inner[i].fp8_meta[w].amax_history for i in (0, 2) for w in ("scaling_fwd", "scaling_bwd")] + \
        [inner[i].fp8_meta[w].scale for i in (0, 2) for w in ("scaling_fwd", "scaling_bwd")]
    assert_same_on_all_ranks(list(inner.parameters()) + states, "DDP weights and FP8 states")
    for p, q, p0 in zip(inner.parameters(), single.parameters(), start):  # the updates agree
        assert sqnr_db(np32(q - p0), np32(p - p0)) >= 40, sqnr_db(np32(q - p0), np32(p - p0))
    for i in (0, 2):  # the forward amaxes are the whole batch's
        hf, _ = state_np(single[i], "scaling_fwd")
        hd, _ = state_np(inner[i], "scaling_fwd")
        np.testing.assert_allclose(hd, hf, rtol=1e-4)


def check_ddp_unused_expert():
    """DDP(find_unused_parameters=True) with an expert that one rank skips: DDP's collectives in backward and
    fp8kit's deferred updates do not interleave badly (no hang), and everything stays identical across ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = te.Linear(16, 16)
            self.experts = torch.nn.ModuleList([te.Linear(16, 16), te.Linear(16, 16)])

        def forward(self, x, skip=None):
            h = self.gate(x)
            return sum(e(h) for i, e in enumerate(self.experts) if i != skip)

    torch.manual_seed(12)
    net = Experts()
    model = DDP(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = DelayedScaling(amax_history_len=4)
    for step in range(4):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(600 + 10 * step + RANK))
        skip = 1 if (step % 2 == 1 and RANK == 1) else None
        with te.autocast(recipe=recipe):
            out = model(x, skip=skip)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    fdist.apply_pending_updates()
    mods = [net.gate, *net.experts]
    assert_same_on_all_ranks(list(net.parameters()) + [m.fp8_meta[w].amax_history for m in mods
                                                       for w in ("scaling_fwd", "scaling_bwd")], "DDP+MoE")
    assert float(net.experts[1].fp8_meta["scaling_bwd"].scale[0]) != 1.0


# ---- check: FSDP2 (fully_shard) --------------------------------------------------------------------------------

def check_fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _mlp(21)
    single = _mlp(21)
    start = [p.detach().clone() for p in single.parameters()]
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model[0].weight.to_local().shape == (64 // WORLD, 32)  # really sharded
    recipe = DelayedScaling(amax_history_len=8)
    local_recipe = DelayedScaling(amax_history_len=8, reduce_amax=False)
    _train_with_single_process_twin(model, single, recipe, local_recipe, steps=3, seed=700)
    for p, q, p0 in zip(model.parameters(), single.parameters(), start):  # the updates agree
        full_p = p.full_tensor()
        assert sqnr_db(np32(q - p0), np32(full_p - p0)) >= 40, sqnr_db(np32(q - p0), np32(full_p - p0))
    states = [model[i].fp8_meta[w].amax_history for i in (0, 2) for w in ("scaling_fwd", "scaling_bwd")]
    assert_same_on_all_ranks(states, "FSDP2 FP8 states")
    assert any(k.endswith("fp8_meta.scaling_fwd.amax_history") for k in model.state_dict())


def check_examples_script():
    """examples/distributed.py runs (its main function) on these ranks."""
    import importlib.util

    path = os.path.join(os.path.dirname(HERE), "examples", "distributed.py")
    spec = importlib.util.spec_from_file_location("fp8kit_example_distributed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(steps=2)


# ---- worker main ------------------------------------------------------------------------------------------------

def _worker(checks):
    out = os.environ["FP8KIT_TEST_OUT"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    results = {}
    path = os.path.join(out, f"result{RANK}.json")
    failed = False
    for name in checks:
        dist.barrier()
        start = time.time()
        try:
            globals()[f"check_{name}"]()
            results[name] = {"ok": True, "error": "", "seconds": time.time() - start}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc(), "seconds": time.time() - start}
            failed = True
        with open(path + ".tmp", "w") as fh:
            json.dump(results, fh)
        os.replace(path + ".tmp", path)
        if failed:  # later collectives could be misaligned: stop here
            break
    if not failed:
        gc.collect()  # see examples/distributed.py: nothing may hold the gloo group past its destruction
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    _worker([c for c in sys.argv[1].split(",") if c])
