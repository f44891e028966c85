"""Linear's Transformer Engine options: the signature, parameters_split, return_bias, fuse_wgrad_accumulation,
delay_wgrad_compute, save_original_input, backward_override, tp_size without a group, the accepted ub_* options."""

import inspect
import warnings

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

import reference as ref
from linear_helpers import np32

TE_LINEAR_ORDER = ["in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation", "tp_group",
                   "tp_size", "get_rng_state_tracker", "rng_tracker_name", "init_method", "bias", "return_bias",
                   "params_dtype", "parallel_mode", "parameters_split", "device", "ub_overlap_ag", "ub_overlap_rs",
                   "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name", "delay_wgrad_compute",
                   "symmetric_ar_type", "save_original_input", "name"]
RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling()]


def test_signature_is_transformer_engines_positional_order_included():
    params = [p for p in inspect.signature(te.Linear.__init__).parameters.values()
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][1:]
    assert [p.name for p in params] == TE_LINEAR_ORDER
    defaults = {p.name: p.default for p in params}
    assert defaults["bias"] is True and defaults["tp_size"] == 1 and defaults["return_bias"] is False
    layer = te.Linear(16, 32, False)  # the third positional argument is sequence_parallel, as in TE
    assert layer.bias is not None and layer.sequence_parallel is False
    assert list(inspect.signature(te.Linear.forward).parameters) == ["self", "inp", "is_first_microbatch",
                                                                     "fp8_output", "fp8_grad"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_parameters_split_equals_one_weight(recipe):
    split = te.Linear(16, 48, parameters_split=("query_", "key_", "value_"))
    assert [n for n, _ in split.named_parameters()] == ["query_weight", "key_weight", "value_weight", "query_bias",
                                                        "key_bias", "value_bias"]
    whole = te.Linear(16, 48)
    with torch.no_grad():
        whole.weight.copy_(torch.cat([split.query_weight, split.key_weight, split.value_weight]))
        whole.bias.copy_(torch.cat([split.query_bias, split.key_bias, split.value_bias]).uniform_())
        for part, b in zip((split.query_bias, split.key_bias, split.value_bias), whole.bias.split(16)):
            part.copy_(b)
    x = torch.randn(8, 16)
    ys = []
    for m in (split, whole):
        with te.autocast(recipe=recipe):
            y = m(x)
        y.square().sum().backward()
        ys.append(y)
    assert torch.equal(*ys)
    assert torch.equal(torch.cat([split.query_weight.grad, split.key_weight.grad, split.value_weight.grad]),
                       whole.weight.grad)
    sized = te.Linear(16, 48, parameters_split={"a": 16, "b": 32})
    assert sized.a_weight.shape == (16, 16) and sized.b_weight.shape == (32, 16)
    with pytest.raises(ValueError, match="do not add up"):
        te.Linear(16, 48, parameters_split={"a": 16, "b": 16})
    with pytest.raises(ValueError, match="need one weight parameter"):
        te.Linear(16, 48, parameters_split=("a", "b"), fuse_wgrad_accumulation=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_return_bias_returns_it_unapplied(recipe):
    layer = te.Linear(16, 16, return_bias=True)
    with torch.no_grad():
        layer.bias.uniform_()
    plain = te.Linear(16, 16, bias=False)
    plain.weight = layer.weight
    x = torch.randn(4, 16)
    with te.autocast(recipe=recipe):
        y, b = layer(x)
        y0 = plain(x)
    assert b is layer.bias and torch.equal(y, y0)
    (y + b).sum().backward()
    assert torch.equal(layer.bias.grad, torch.full((16,), 4.0))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fuse_wgrad_accumulation_adds_float32_into_main_grad(recipe):
    import copy

    torch.manual_seed(0)
    fused = te.Linear(16, 32, fuse_wgrad_accumulation=True, params_dtype=torch.bfloat16)
    fused.weight.main_grad = torch.full((32, 16), 7.0)  # stale: the first microbatch overwrites it
    want = torch.zeros(32, 16)
    for i in range(2):
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        probe = copy.deepcopy(fused)  # the same weights and FP8 state: the same FP8 operands
        probe.weight.main_grad = torch.zeros(32, 16)
        plain = copy.deepcopy(fused)
        plain.fuse_wgrad_accumulation = False
        for m in (fused, probe, plain):
            with te.autocast(recipe=recipe):
                y = m(x, is_first_microbatch=(i == 0))
            y.float().square().sum().backward()
        wgrad32 = probe.weight.main_grad
        assert torch.equal(plain.weight.grad, wgrad32.to(torch.bfloat16))  # the same GEMM, rounded once to bf16
        want += wgrad32
    assert fused.weight.grad is None
    assert torch.equal(fused.weight.main_grad, want)
    fused.weight.grad_added_to_main_grad = False  # Megatron's flag: set, and a dummy zero gradient returned
    with te.autocast(recipe=recipe):
        fused(x).float().sum().backward()
    assert fused.weight.grad_added_to_main_grad is True and torch.equal(fused.weight.grad, torch.zeros(32, 16))


@pytest.mark.parametrize("recipe", RECIPES)
def test_delay_wgrad_compute_leaves_dw_for_backward_dw(recipe):
    torch.manual_seed(1)
    delayed = te.Linear(16, 16, delay_wgrad_compute=True)
    now = te.Linear(16, 16)
    now.load_state_dict(delayed.state_dict())
    x = torch.randn(8, 16, requires_grad=True)
    for m in (delayed, now):
        with te.autocast(recipe=recipe):
            m(x).square().sum().backward()
    assert delayed.weight.grad is None and delayed.need_backward_dw()
    assert torch.equal(delayed.bias.grad, now.bias.grad)
    delayed.backward_dw()
    assert torch.equal(delayed.weight.grad, now.weight.grad) and not delayed.need_backward_dw()


def test_save_original_input_keeps_the_input_and_gives_the_same_gradients():
    recipe = Float8CurrentScaling()
    torch.manual_seed(2)
    a, b = te.Linear(64, 64, save_original_input=True), te.Linear(64, 64)
    b.load_state_dict(a.state_dict())
    x = torch.randn(32, 64, requires_grad=True)
    saved = {}
    for name, m in (("original", a), ("fp8", b)):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.dtype) or t, lambda t: t):
            with te.autocast(recipe=recipe):
                y = m(x)
        saved[name] = sizes
        y.square().sum().backward()
    assert torch.float32 in saved["original"] and torch.float32 not in [d for d in saved["fp8"] if d != torch.float32]
    assert torch.equal(a.weight.grad, b.weight.grad)
    with pytest.raises(ValueError, match="save_original_input"):
        with te.autocast(recipe=DelayedScaling()):
            a(x)


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
def test_backward_override(mode):
    recipe = Float8CurrentScaling(backward_override=mode)
    layer = te.Linear(32, 16, bias=False)
    x = torch.randn(8, 32, requires_grad=True)
    g = torch.randn(8, 16)
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.backward(g)
    if mode == "high_precision":
        w, xin = layer.weight.detach(), x.detach()
    else:  # the FP8 operands of the forward, dequantized (the reference cast)
        def deq(t):
            q, inv = ref.cast(np32(t), "e4m3", ref.current_scale(ref.amax(np32(t)), 448.0))
            return torch.from_numpy(ref.dequantize(q, "e4m3", inv))
        w, xin = deq(layer.weight), deq(x)
    assert torch.equal(x.grad, g @ w)
    assert torch.equal(layer.weight.grad, g.t() @ xin)


def test_tp_size_without_a_group_needs_set_tensor_parallel_group():
    layer = te.Linear(16, 32, tp_size=2, parallel_mode="column")
    assert layer.weight.shape == (16, 16) and layer.out_features == 16
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        layer(torch.randn(4, 16))


def test_userbuffer_options_are_accepted_and_change_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = te.Linear(16, 16, ub_overlap_ag=True, ub_name="qkv", symmetric_ar_type="two_shot")
    assert any("userbuffers" in str(w.message) for w in caught)
    b = te.Linear(16, 16)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 16)
    with te.autocast():
        assert torch.equal(a(x), b(x))


def test_fp8_output_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="fp8_output"):
        te.Linear(16, 16)(torch.randn(2, 16), fp8_output=True)


# ---- fuse_wgrad_accumulation in any precision (Transformer Engine puts dW into main_grad whenever it is set) ----

_FUSED_MODULES = {
    "Linear": (lambda **kw: te.Linear(16, 32, **kw), lambda m, x, first: m(x, is_first_microbatch=first)),
    "LayerNormLinear": (lambda **kw: te.LayerNormLinear(16, 32, **kw),
                        lambda m, x, first: m(x, is_first_microbatch=first)),
    "LayerNormMLP": (lambda **kw: te.LayerNormMLP(16, 32, **kw), lambda m, x, first: m(x, is_first_microbatch=first)),
    "GroupedLinear": (lambda **kw: te.GroupedLinear(2, 16, 32, **kw),
                      lambda m, x, first: m(x, [3, 5], is_first_microbatch=first)),
}


def _gemm_weights(m):
    return [(n, p) for n, p in m.named_parameters() if "weight" in n and not n.startswith("layer_norm")]


@pytest.mark.parametrize("kind", list(_FUSED_MODULES))
@pytest.mark.parametrize("precision", ["plain", "fp8kit_disabled", "torch_autocast"])
def test_fuse_wgrad_accumulation_puts_dw_into_main_grad_in_any_precision(kind, precision):
    import contextlib
    import copy

    make, call = _FUSED_MODULES[kind]
    dtype = torch.bfloat16 if precision == "plain" else torch.float32
    torch.manual_seed(3)
    fused = make(fuse_wgrad_accumulation=True, params_dtype=dtype)
    with torch.no_grad():
        for p in fused.parameters():
            p.uniform_(-1, 1)
    ref = copy.deepcopy(fused).double()  # the plain float64 gradients
    ref.fuse_wgrad_accumulation = False
    for _, w in _gemm_weights(fused):
        w.main_grad = torch.full(w.shape, 5.0)  # stale: the first microbatch (is_first_microbatch=True) overwrites it
    ctx = {"plain": contextlib.nullcontext, "fp8kit_disabled": lambda: te.autocast(enabled=False),
           "torch_autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[precision]
    for first in (True, False):
        x = torch.randn(8, 16).to(dtype)
        dy = torch.randn(8, 16 if kind == "LayerNormMLP" else 32)
        with ctx():
            y = call(fused, x, first)
        dy = dy.to(y.dtype)
        y.backward(dy)
        call(ref, x.double(), None).backward(dy.double())
    for (name, w), (_, w64) in zip(_gemm_weights(fused), _gemm_weights(ref)):
        assert w.grad is None, name
        assert w.main_grad.dtype == torch.float32
        # a single GEMM: float32 sums of products of the rounded operands; behind a norm or an activation the
        # operands themselves are rounded to the activation dtype
        exact = kind in ("Linear", "GroupedLinear") and precision != "torch_autocast"
        tol = 1e-5 if exact else (2e-2 if dtype == torch.bfloat16 or precision == "torch_autocast" else 1e-5)
        torch.testing.assert_close(w.main_grad.double(), w64.grad, rtol=tol, atol=tol * w64.grad.abs().max())
    bias = [p for n, p in fused.named_parameters() if "bias" in n and p is not None]
    assert all(b.grad is not None for b in bias)  # only weight gradients go to main_grad


@pytest.mark.parametrize("kind", list(_FUSED_MODULES))
def test_fuse_wgrad_accumulation_outside_fp8_megatron_flags(kind):
    make, call = _FUSED_MODULES[kind]
    torch.manual_seed(4)
    m = make(fuse_wgrad_accumulation=True)
    x = torch.randn(8, 16)
    weights = [w for _, w in _gemm_weights(m)]
    for w in weights:
        w.main_grad = torch.full(w.shape, 3.0)
        w.overwrite_main_grad = True  # the weight's attribute: overwrite, whatever is_first_microbatch says
        w.grad_added_to_main_grad = False  # Megatron's DDP flag: set, and a dummy gradient returned
    call(m, x, None).sum().backward()
    first = [w.main_grad.clone() for w in weights]
    call(m, x, None).sum().backward()
    for w, g in zip(weights, first):
        assert torch.equal(w.main_grad, g) and not torch.equal(g, torch.full(w.shape, 3.0))
        assert w.grad_added_to_main_grad is True and torch.equal(w.grad, torch.zeros(w.shape))
    del weights[0].main_grad
    with pytest.raises(RuntimeError, match="main_grad"):
        call(m, x, None).sum().backward()


@pytest.mark.parametrize("kind", list(_FUSED_MODULES))
def test_delay_wgrad_compute_outside_fp8_waits_for_backward_dw(kind):
    import copy

    make, call = _FUSED_MODULES[kind]
    torch.manual_seed(5)
    delayed = make(delay_wgrad_compute=True)
    now = copy.deepcopy(delayed)
    now.wgrad_store = None
    if hasattr(now, "wgrad_stores"):
        now.wgrad_stores = None
    x = torch.randn(8, 16)
    for m in (delayed, now):
        call(m, x, None).square().sum().backward()
    assert all(w.grad is None for _, w in _gemm_weights(delayed)) and delayed.need_backward_dw()
    delayed.backward_dw()
    for (_, a), (_, b) in zip(_gemm_weights(delayed), _gemm_weights(now)):
        assert torch.equal(a.grad, b.grad)
