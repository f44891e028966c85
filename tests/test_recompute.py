"""Activation recompute repeats the FP8 forward exactly (SPEC section 8b): gradients, amax histories and scales are
bit-identical to the same steps without recompute, whichever checkpoint runs it and wherever autocast sits."""

import contextlib

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import fp8kit.pytorch as te
from fp8kit.pytorch import host
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

CHECKPOINTS = {
    "te-reentrant": lambda f, x: te.checkpoint(f, x, use_reentrant=True),
    "te-nonreentrant": lambda f, x: te.checkpoint(f, x, use_reentrant=False),
    "torch-reentrant": lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=True),
    "torch-nonreentrant": lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False),
}
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent"),
    "delayed-max": DelayedScaling(amax_history_len=3, margin=1),
    "current": Float8CurrentScaling(),
}


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = te.Linear(width, 2 * width), te.Linear(2 * width, width)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


class Model(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.inp = te.Linear(16, 32, params_dtype=dtype)
        self.blocks = torch.nn.ModuleList([Block(32).to(dtype) for _ in range(2)])
        self.head = te.Linear(32, 16, params_dtype=dtype)


def _inputs(steps, dtype):
    g = torch.Generator().manual_seed(1)
    # magnitudes change every step, so the delayed scales move between a forward and its recompute
    return [(torch.randn(8, 16, generator=g) * 2.0 ** ((3 * s) % 7 - 3)).to(dtype) for s in range(steps)]


def _states(model):
    out = []
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        for name in ("scaling_fwd", "scaling_bwd"):
            if meta is not None and meta[name] is not None:
                out += [meta[name].amax_history.clone(), meta[name].scale.clone(), meta[name].count.clone()]
    return out


def train(recipe, checkpoint, placement, steps=4, dtype=torch.float32):
    """Run `steps` SGD steps; return everything that must match: per step the input gradient, the parameter
    gradients, and every history, scale and counter after the step."""
    torch.manual_seed(0)
    model = Model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = CHECKPOINTS.get(checkpoint, lambda f, x: f(x))
    seen = []
    for x in _inputs(steps, dtype):
        x = x.clone().requires_grad_()
        if placement == "outside":
            with te.autocast(recipe=recipe):
                h = model.inp(x)
                for block in model.blocks:
                    h = ckpt(block, h)
                y = model.head(h)
        else:
            def region(block):
                def run(h):
                    with te.autocast(recipe=recipe):
                        return block(h)
                return run

            with te.autocast(recipe=recipe):
                h = model.inp(x)
            for block in model.blocks:
                h = ckpt(region(block), h)
            with te.autocast(recipe=recipe):
                y = model.head(h)
        loss = (y.float() ** 2).mean()
        opt.zero_grad()
        loss.backward()
        seen.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()] + _states(model))
        opt.step()
    return seen


def assert_identical(got, want):
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(b)
        for i, (u, v) in enumerate(zip(a, b)):
            assert u.dtype == v.dtype and u.shape == v.shape, (step, i)
            assert torch.equal(u.view(torch.uint8) if u.is_floating_point() else u,
                               v.view(torch.uint8) if v.is_floating_point() else v), \
                f"step {step}, tensor {i}: max diff {(u.double() - v.double()).abs().max()}"


@pytest.fixture(params=["host", "tensor"])
def path(request):
    with contextlib.nullcontext() if request.param == "host" else host.tensor_path():
        yield request.param


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("placement", ["outside", "inside"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recompute_is_bit_identical_to_no_recompute(recipe, placement, checkpoint, path):
    want = train(RECIPES[recipe], None, placement)
    got = train(RECIPES[recipe], checkpoint, placement)
    assert_identical(got, want)


def test_the_test_scales_move_between_forward_and_recompute():
    """Without moving scales the bit-identity above could not tell a recompute with stale scales from a right one."""
    seen = train(RECIPES["delayed"], None, "outside")
    fwd_scales = [step[-6] for step in seen]  # the head's forward scale after every step
    assert all(not torch.equal(a, b) for a, b in zip(fwd_scales, fwd_scales[1:]))


def test_bf16_recompute_identical():
    want = train(RECIPES["delayed"], None, "outside", dtype=torch.bfloat16)
    got = train(RECIPES["delayed"], "torch-nonreentrant", "outside", dtype=torch.bfloat16)
    assert_identical(got, want)


def test_recompute_records_no_amax_and_leaves_no_pending_update():
    recipe = RECIPES["delayed-max"]
    torch.manual_seed(0)
    block = Block(32)
    x = torch.randn(4, 32, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
    staged = [block.up.fp8_meta["scaling_fwd"].amax_history[0].clone(),
              block.down.fp8_meta["scaling_fwd"].amax_history[0].clone()]
    assert all(s.abs().sum() == 0 for s in staged)  # rolled at the exit
    y.sum().backward()  # the recompute runs here
    assert block.up.fp8_meta["scaling_fwd"].amax_history[0].abs().sum() == 0
    assert block.down.fp8_meta["scaling_fwd"].amax_history[0].abs().sum() == 0
    assert block.up.fp8_meta["scaling_bwd"].update_count == 1  # the backward update ran once


def test_forward_during_backward_without_an_original_is_refused():
    layer = te.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def hook(grad):
        with te.autocast(recipe=DelayedScaling()):
            te.Linear(16, 16)(torch.randn(4, 16))  # a fresh module: nothing to repeat
        return grad

    y = layer(x)
    y.register_hook(hook)
    with pytest.raises(RuntimeError, match="fp8kit: Linear ran an FP8 forward during a backward pass"):
        y.sum().backward()


def test_checkpoint_signature_and_options():
    import inspect

    params = inspect.signature(te.checkpoint).parameters
    assert list(params)[:2] == ["function", "args"]
    for name, default in (("distribute_saved_activations", False), ("get_rng_state_tracker", None),
                          ("tp_group", None), ("use_reentrant", True)):
        assert params[name].default == default and params[name].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError, match="callable"):
        te.checkpoint(3, torch.ones(1))
    with pytest.raises(RuntimeError, match="torch.distributed"):
        te.checkpoint(torch.nn.Identity(), torch.ones(1, requires_grad=True), distribute_saved_activations=True)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_replays_rng_tracker_states(use_reentrant):
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    drop = torch.nn.Dropout(0.5)

    def f(h):
        with tracker.fork():
            return drop(h) * 3

    x = torch.randn(64, requires_grad=True)
    y = te.checkpoint(f, x, get_rng_state_tracker=lambda: tracker, use_reentrant=use_reentrant)
    y.sum().backward()
    mask = (y.detach() != 0).float()
    assert torch.equal(x.grad, mask * 2 * 3)  # the recompute drew the same dropout mask (kept values x2)
    assert 0 < mask.mean() < 1


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recompute_queries_as_in_transformer_engine(use_reentrant):
    """TE's test_numerics.py::test_checkpoint_inner_autocast_is_an_fp8_recompute_region, ported: inside te.checkpoint
    the region counts as an FP8 recompute region only inside an enabled autocast, in both phases; the phase query
    says which pass runs. Outside te.checkpoint (torch's own checkpoint included) both are False."""
    from fp8kit.pytorch.distributed import in_fp8_activation_recompute_phase, is_fp8_activation_recompute_enabled

    recipe = DelayedScaling()
    layer = te.Linear(16, 16, bias=False)
    observed = []

    def body(value):
        outside = is_fp8_activation_recompute_enabled()
        with te.autocast(enabled=True, recipe=recipe):
            observed.append((outside, is_fp8_activation_recompute_enabled(), in_fp8_activation_recompute_phase()))
            return layer(value)

    inp = torch.randn(16, 16, requires_grad=True)
    te.checkpoint(body, inp, use_reentrant=use_reentrant).sum().backward()
    assert observed == [(False, True, False), (False, True, True)]
    assert torch.isfinite(inp.grad).all() and torch.isfinite(layer.weight.grad).all()

    observed.clear()
    with te.autocast(enabled=True, recipe=recipe):
        assert not is_fp8_activation_recompute_enabled() and not in_fp8_activation_recompute_phase()
    torch.utils.checkpoint.checkpoint(body, inp, use_reentrant=use_reentrant).sum().backward()
    assert observed == [(False, False, False)] * 2
    with te.autocast(enabled=False):
        te.checkpoint(lambda v: (observed.append(is_fp8_activation_recompute_enabled()), layer(v))[1], inp,
                      use_reentrant=use_reentrant).sum().backward()
    assert observed[-2:] == [False, False]  # no FP8 autocast: not an FP8 recompute region


def _block_of(module):
    return module.fp8_meta["scaling_fwd"]._block


@pytest.mark.parametrize("after", ["nothing", "a torch.compile error"])
def test_scale_snapshot_buffers_are_reused_only_when_nothing_refers_to_them(after):
    """The update copies the scales a recompute needs into a buffer an earlier step's records left, so that a
    steady-state exit allocates nothing; a buffer that a view or another Python name still refers to is never
    reused (its values stay). Also after a torch.compile error in the process, which leaves a frame's arguments
    showing one more reference than its locals (torch 2.13): a check that compared the two kept nothing there."""
    if after != "nothing":
        @torch.compile(fullgraph=True, backend="eager")
        def refused(t):
            torch._dynamo.graph_break()
            return t + 1

        with pytest.raises(Exception):
            refused(torch.ones(2))
    layers = torch.nn.Sequential(te.Linear(16, 16), te.Linear(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    # a recipe key no other test uses: a key's flat buffer pinned by an earlier test's captured graph takes no states
    recipe = DelayedScaling(amax_history_len=13, margin=3)

    def step(scale_x=1.0):
        with te.autocast(recipe=recipe):
            y = layers(x * scale_x)
        owner = layers[0]._fp8_records._records[-1].scales.owner  # this step's BlockScales
        y.sum().backward()
        return owner

    with host.tensor_path():
        step()
        assert _block_of(layers[0]) is not None and _block_of(layers[0]) is _block_of(layers[1])
        addresses = []
        for i in range(4):
            addresses.append(step(1.0 + i).saved.data_ptr())  # saved by the exit of this step
        assert len(set(addresses)) <= 2, "no snapshot buffer was reused"
        for j, hold in enumerate(("view", "name")):
            owner = step(5.0)
            held = owner.saved[0] if hold == "view" else owner.saved
            value = held.clone()
            del owner
            for i in range(3):
                step(7.0 * (j + 1) + i)
            assert torch.equal(held, value), hold
            assert layers[0].fp8_meta["scaling_fwd"].scale[0] != value.reshape(-1)[0], "the scales did not move"


@pytest.mark.parametrize("path_name", ["host", "tensor"])
def test_recompute_with_two_steps_in_flight(path_name):
    """Two microbatches' forwards, each its own autocast step, before either backward (first in, first out, as a
    pipeline schedule runs them and as Transformer Engine's recompute queue assumes): each recompute casts with its
    own step's scales (the second step's exit changed them), so the gradients equal those without checkpointing."""
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")

    def run(ckpt):
        torch.manual_seed(0)
        block = Block(16)
        grads = []
        with contextlib.nullcontext() if path_name == "host" else host.tensor_path():
            for s in range(3):
                xs = [(torch.randn(4, 16) * 2.0 ** (2 * s + i)).requires_grad_() for i in range(2)]
                ys = []
                for x in xs:
                    with te.autocast(recipe=recipe):
                        ys.append(ckpt(block, x))
                for y in ys:
                    y.pow(2).sum().backward()
                grads += [x.grad.clone() for x in xs] + [p.grad.clone() for p in block.parameters()]
                block.zero_grad()
        return grads

    want = run(lambda f, x: f(x))
    got = run(lambda f, x: te.checkpoint(f, x, use_reentrant=False))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
