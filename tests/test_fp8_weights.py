"""FP8 weights (quantized_model_init): Float8Tensor parameters used as they are by the FP8 GEMMs, their scales under
both recipes, optimizer steps, checkpoints that load with weights_only and resume exactly."""

import copy
import io
import warnings

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

import reference as ref
from linear_helpers import assert_gemm_close, np32

RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling()]


def weight_bytes(p) -> np.ndarray:
    assert p._data.dtype == torch.uint8  # Transformer Engine's layout: the bytes, `_fp8_dtype` names the format
    return p._data.contiguous().numpy()


@pytest.mark.parametrize("recipe", RECIPES)
def test_weights_are_float8_parameters_at_half_the_memory(recipe):
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=recipe):
        m = te.Linear(64, 32, params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    plain = te.Linear(64, 32, params_dtype=torch.bfloat16)
    w = m.weight
    assert isinstance(w, te.Float8Tensor) and isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert w.dtype == torch.bfloat16 and w.shape == (32, 64)
    assert w._data.element_size() * w._data.numel() == plain.weight.numel()  # one byte per element, bf16 has two
    assert not isinstance(m.bias, te.Float8Tensor)
    # the bytes are the cast of the same initial weight (delayed: scale 1 at init; current: its own amax)
    w0 = np32(plain.weight)
    scale = 1.0 if isinstance(recipe, DelayedScaling) else ref.current_scale(ref.amax(w0), 448.0)
    want, inv = ref.cast(w0, "e4m3", scale)
    assert np.array_equal(weight_bytes(w), want) and w._scale_inv.item() == inv


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_uses_the_weight_bytes_without_casting(recipe):
    torch.manual_seed(1)
    with te.quantized_model_init(recipe=recipe):
        m = te.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    with te.autocast(recipe=recipe):
        y = m(x)
    if isinstance(recipe, DelayedScaling):
        x_scale = 1.0  # the first step casts with scale 1
    else:
        x_scale = ref.current_scale(ref.amax(np32(x)), 448.0)
    xq, x_inv = ref.cast(np32(x), "e4m3", x_scale)
    a = ref.dequantize(xq, "e4m3", x_inv).astype(np.float64)
    b = ref.dequantize(weight_bytes(m.weight), "e4m3", m.weight._scale_inv.item()).astype(np.float64).T
    assert_gemm_close(y, a @ b, a, b, 2.0 ** -24)


def test_delayed_weight_amax_comes_from_its_quantization():
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(2)
    with te.quantized_model_init(recipe=recipe):
        m = te.Linear(32, 32)
    w0 = m.weight.dequantize(dtype=torch.float32)  # at init: scale 1, the initial weight's amax staged
    init_amax = m.fp8_meta["scaling_fwd"].amax_history[0, 1].item()
    assert init_amax > 0
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    amaxes = [init_amax]
    for step in range(3):
        with te.autocast(recipe=recipe):
            y = m(torch.randn(8, 32))
        y.square().sum().backward()
        opt.step()  # in-place update: requantized with the weight slot's current scale, amax staged
        opt.zero_grad()
        amaxes.append(m.fp8_meta["scaling_fwd"].amax_history[0, 1].item())
    hist = m.fp8_meta["scaling_fwd"].amax_history[:, 1].tolist()
    # each forward's update rolled the staged weight amax (from the last quantization), none from a forward cast
    assert hist[1:] == amaxes[:3] and hist[0] == amaxes[3]
    assert w0.shape == (32, 32)


def test_an_idle_model_rolls_its_staged_weight_amax_at_the_next_update_of_its_key():
    """Transformer Engine's rule: modules stay registered under their key (recipe, group) and take part in every
    update of it, whether they ran or not; a slot rolls when its staging row holds an amax. An FP8 weight's slot is
    staged by the optimizer's requantization, after the step's update, so when a model stops, another model
    trained under the same key rolls that amax into the idle model's history at its first update (and nothing
    after: the other slots had nothing staged). A model under another key leaves it alone."""
    recipe = DelayedScaling(amax_history_len=4)

    def make(seed, r):
        torch.manual_seed(seed)
        with te.quantized_model_init(recipe=r):
            m = te.Linear(32, 32)
        return m, torch.optim.SGD(m.parameters(), lr=0.5)

    def train(m, opt, r, steps):
        for _ in range(steps):
            with te.autocast(recipe=r):
                y = m(torch.randn(8, 32))
            y.square().sum().backward()
            opt.step()
            opt.zero_grad()

    def state(m):
        return [t.clone() for k in ("scaling_fwd", "scaling_bwd") for t in (m.fp8_meta[k].amax_history,
                                                                             m.fp8_meta[k].scale)]

    idle, opt = make(4, recipe)
    train(idle, opt, recipe, 2)
    stopped = state(idle)
    assert stopped[0][0, 1] > 0 and stopped[0][0, 0] == 0  # the weight amax staged, the input's rolled
    other_key = DelayedScaling(amax_history_len=4, margin=1)
    train(*make(5, other_key), other_key, 2)
    assert all(torch.equal(a, b) for a, b in zip(state(idle), stopped))
    train(*make(6, recipe), recipe, 2)
    want = ref.DelayedState(4, 3, 448.0)
    want.history[:], want.scale[:] = stopped[0].numpy(), stopped[1].numpy()
    want.update()
    now = state(idle)
    assert np.array_equal(now[0].numpy(), want.history) and np.array_equal(now[1].numpy(), want.scale)
    assert not np.array_equal(want.history, stopped[0].numpy())  # it did roll
    assert torch.equal(now[2], stopped[2]) and torch.equal(now[3], stopped[3])  # backward: nothing staged


def test_current_scaling_requantizes_after_each_step():
    recipe = Float8CurrentScaling()
    torch.manual_seed(3)
    with te.quantized_model_init(recipe=recipe):
        m = te.Linear(32, 32, bias=False)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    with te.autocast(recipe=recipe):
        y = m(torch.randn(8, 32))
    y.square().sum().backward()
    before = m.weight.dequantize(dtype=torch.float32)
    grad = m.weight.grad.float()
    opt.step()
    updated = np32((before - 0.5 * grad).to(torch.float32))
    want, inv = ref.cast(updated, "e4m3", ref.current_scale(ref.amax(updated), 448.0))
    assert np.array_equal(weight_bytes(m.weight), want) and m.weight._scale_inv.item() == inv


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_loads_weights_only_and_resumes_exactly(recipe):
    def make():
        torch.manual_seed(4)
        with te.quantized_model_init(recipe=recipe):
            return torch.nn.Sequential(te.Linear(32, 64), torch.nn.GELU(), te.Linear(64, 32))

    def train(model, opt, seed, steps):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            with te.autocast(recipe=recipe):
                loss = model(torch.randn(8, 32, generator=g) * 3).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    straight = make()
    opt = torch.optim.SGD(straight.parameters(), lr=0.1)
    train(straight, opt, 0, 2)
    buf = io.BytesIO()
    torch.save(straight.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert isinstance(state["0.weight"], te.Float8Tensor)
    resumed = make()
    resumed.load_state_dict(state)
    twin = copy.deepcopy(straight)
    after = []
    for m in (straight, resumed, twin):
        train(m, torch.optim.SGD(m.parameters(), lr=0.1), 1, 2)
        # read right after its own steps: an idle model's staged weight amax rolls at another model's update of
        # the same key (test_an_idle_model_rolls_its_staged_weight_amax_at_the_next_update_of_its_key)
        after.append(copy.deepcopy(m.state_dict()))
    for a, b, c in zip(*(d.values() for d in after)):
        for u in (b, c):
            if isinstance(a, te.Float8Tensor):
                assert torch.equal(a._data.view(torch.uint8), u._data.view(torch.uint8))
                assert torch.equal(a._scale_inv, u._scale_inv)
            else:
                assert torch.equal(a, u)


def test_preserve_high_precision_init_val_and_errors():
    torch.manual_seed(5)
    with te.fp8_model_init(preserve_high_precision_init_val=True):
        m = te.Linear(16, 16)
    torch.manual_seed(5)
    plain = te.Linear(16, 16)
    assert torch.equal(m.weight.get_high_precision_init_val(), plain.weight.detach())
    assert m.weight._high_precision_init_val.device.type == "cpu"  # Transformer Engine's attribute
    seq = torch.nn.Sequential(m)
    for move in (lambda: seq.cpu(), lambda: seq.to("cpu"), lambda: seq.to(torch.device("cpu"))):
        move()  # torch swaps a subclass parameter's contents; its attributes stay
        assert torch.equal(m.weight.get_high_precision_init_val(), plain.weight.detach())
    m.weight.clear_high_precision_init_val()
    assert m.weight.get_high_precision_init_val() is None and not hasattr(m.weight, "_high_precision_init_val")
    with te.quantized_model_init(enabled=False):
        assert not isinstance(te.Linear(16, 16).weight, te.Float8Tensor)
    with pytest.raises(ValueError, match="parameters_split"):
        with te.quantized_model_init():
            te.Linear(16, 32, parameters_split=("a", "b"))
    with te.quantized_model_init(recipe=DelayedScaling(fp8_format=Format.E5M2)):
        e5 = te.Linear(16, 16)
    with pytest.raises(TypeError, match="quantized weight holds"):
        with te.autocast(recipe=DelayedScaling()):
            e5(torch.randn(2, 16))


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "GroupedLinear"])
def test_quantizer_is_being_updated_warning_on_a_new_history_length(kind):
    """Transformer Engine warns when a module's FP8 weights get new quantizers because the autocast recipe's
    amax_history_len differs from the one they were made with; fp8kit warns alike, once, and keeps the weights'
    scales bound to the module's (resized) forward state."""
    with te.quantized_model_init(recipe=DelayedScaling(amax_history_len=1024)):
        m = te.GroupedLinear(1, 32, 32) if kind == "GroupedLinear" else getattr(te, kind)(32, 32)
    x = torch.randn(8, 32)
    args = (x, [8]) if kind == "GroupedLinear" else (x,)
    recipe = DelayedScaling(amax_history_len=1)
    with pytest.warns(UserWarning, match="Quantizer is being updated, this may affect model behavior"):
        with te.autocast(recipe=recipe):
            m(*args).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.autocast(recipe=recipe):
            m(*args)
    state = m.fp8_meta["scaling_fwd"]
    for p in m.parameters():
        if isinstance(p, te.Float8Tensor):
            assert p._quantizer.state is state and state.history_len == 1
    w = next(p for p in m.parameters() if isinstance(p, te.Float8Tensor))
    w.update_quantizer(w._quantizer)  # the same quantizer: no warning
    w._quantizer = None
    with pytest.raises(RuntimeError, match="no quantizer"):
        w.update_quantizer(None)


@pytest.mark.parametrize("move", ["cpu", "float", "to_empty"])
def test_attributes_of_fp8_weights_survive_module_moves(move):
    # nn.Module._apply swaps tensor-subclass parameters with torch.utils.swap_tensors, which also swaps __dict__
    torch.manual_seed(6)
    with te.quantized_model_init(preserve_high_precision_init_val=True):
        m = te.LayerNormMLP(16, 32)
    torch.manual_seed(6)
    plain = te.LayerNormMLP(16, 32)
    m.fc1_weight.tag = "mine"
    m = {"cpu": m.cpu, "float": m.float, "to_empty": lambda: m.to_empty(device="cpu")}[move]()
    for name in ("fc1_weight", "fc2_weight"):
        w = getattr(m, name)
        assert isinstance(w, te.Float8Tensor)
        # the init value is what plain initialisation drew (independent of the FP8 weight's bytes)
        assert torch.equal(w.get_high_precision_init_val(), getattr(plain, name).detach())
        assert w._high_precision_init_val.device.type == "cpu"
    assert m.fc1_weight.tag == "mine"
    m.fc1_weight.clear_high_precision_init_val()
    assert m.fc1_weight.get_high_precision_init_val() is None and not hasattr(m.fc1_weight, "_high_precision_init_val")
    assert m.fc2_weight.get_high_precision_init_val() is not None  # each weight's accessors read their own value


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_get_quantizer_requantizes_the_high_precision_init_value(recipe):
    # TE's way to rebuild an FP8 weight from its kept initial value: weight._get_quantizer() makes and fills a new
    # tensor; its bytes must be those of the reference cast of that value with the weight's scale
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        layer = te.Linear(32, 48)
    w = layer.weight
    q = w._get_quantizer()
    assert q is w._quantizer
    hp = w.get_high_precision_init_val()
    fresh = q.make_empty(shape=w.shape, dtype=w.dtype, device=w.device)
    q.update_quantized(hp.to(w.device), fresh)
    scale = 1.0 / float(w._scale_inv)
    expected, _ = ref.cast(hp.float().numpy(), "e4m3", scale)
    np.testing.assert_array_equal(fresh._data.numpy(), expected)
    np.testing.assert_array_equal(w._data.numpy(), expected)
    # without a quantizer of its own, a Float8Tensor has no default one (TE raises the same ValueError), so it cannot
    # be written from high-precision values; a Float8Tensor of the same format still copies its bytes
    bare = te.Float8Tensor(shape=[2, 2], dtype=torch.float32, data=torch.zeros(2, 2, dtype=torch.uint8),
                           fp8_dtype=te.DType.kFloat8E4M3, fp8_scale_inv=torch.full([1], 0.5))
    msg = "Float8Tensor has no quantizer and no default quantizer is available defined in the subclass"
    for write in (bare._get_quantizer, lambda: bare.quantize_(torch.ones(2, 2)), lambda: bare.copy_(torch.ones(2, 2)),
                  lambda: bare.mul_(2)):
        with pytest.raises(ValueError, match=msg):
            write()
    assert torch.equal(bare._data, torch.zeros(2, 2, dtype=torch.uint8))  # nothing written
    bare.copy_(w[:2, :2].contiguous())
    np.testing.assert_array_equal(bare._data.numpy(), expected[:2, :2])
