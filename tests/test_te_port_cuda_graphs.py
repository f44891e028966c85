"""Our port of Transformer Engine's tests/pytorch/test_cuda_graphs.py: training through make_graphed_callables (a
whole model or each layer) gives the eager run's bits under each per-tensor recipe, with weight caching across
microbatches, keyword arguments, and parameter gradients returned as tensors of their own. On a CPU the callables
are compiled instead of captured (docs/pytorch.md), so the cases are few and small."""

import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

HIDDEN, TOKENS = 32, 32
RECIPES = {"none": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling()}


def _data(seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, HIDDEN, generator=g).requires_grad_(requires_grad)


def _train(mode, recipe, module, caching):
    torch.manual_seed(1)
    layers = [module() for _ in range(2)]
    enabled = recipe is not None
    opts = dict(num_warmup_iters=2, enabled=enabled, recipe=recipe, cache_quantized_params=caching)
    if mode == "full":
        model = te.make_graphed_callables(torch.nn.Sequential(*layers), (_data(0),), **opts)
        call = model
    elif mode == "individual":
        graphed = [te.make_graphed_callables(m, (_data(0),), **opts) for m in layers]

        def call(x, **kw):
            for m in graphed:
                x = m(x, **kw)
            return x
    else:
        def call(x, **kw):
            for m in layers:
                x = m(x, **kw)
            return x
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        for micro in range(2):
            x, dy = _data(10 * step + micro), _data(100 + micro, False)
            kw = {"is_first_microbatch": micro == 0} if caching else {}
            with te.autocast(enabled=enabled, recipe=recipe):
                out = call(x, **kw)
            out.backward(dy)
        opt.step()
    return [out.detach(), x.grad] + [p.detach().clone() for p in params]


_SLOW = pytest.mark.slow  # each graphed run compiles (tens of seconds on a shared 2-core machine)


@pytest.mark.parametrize("recipe,module,caching,mode", [
    ("delayed", "linear", False, "full"),
    pytest.param("none", "linear", False, "individual", marks=_SLOW),
    pytest.param("delayed", "linear", False, "individual", marks=_SLOW),
    pytest.param("current", "layernorm_linear", True, "full", marks=_SLOW),
    pytest.param("current", "layernorm_linear", True, "individual", marks=_SLOW),
])
def test_make_graphed_callables_replays_eager_bits(recipe, module, caching, mode):
    make = {"linear": lambda: te.Linear(HIDDEN, HIDDEN),
            "layernorm_linear": lambda: te.LayerNormLinear(HIDDEN, HIDDEN)}[module]
    eager = _train("none", RECIPES[recipe], make, caching)
    for got, want in zip(_train(mode, RECIPES[recipe], make, caching), eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["default", "skip_post_hook", "no_clone"])
def test_make_graphed_callables_returns_owned_parameter_grads(policy):
    # also for a parameter marked skip_backward_post_hook and with clone_param_grads_on_return=False: compiled on a
    # CPU, there is no static gradient buffer to hand back (TE's captured graph returns the same buffer then)
    torch.manual_seed(0)
    linear = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
    if policy == "skip_post_hook":
        linear.weight.skip_backward_post_hook = True
    model = te.make_graphed_callables(linear, (_data(0, False),), clone_param_grads_on_return=policy != "no_clone")
    seen = []
    hook = model.weight.register_hook(lambda g: seen.append(g) or g)
    try:
        grads = []
        for i in range(2):
            x, dy = _data(i, False), _data(10 + i, False)
            model(x).backward(dy)
            grads.append(dy.T @ x)  # the weight gradient, computed here
            model.zero_grad(set_to_none=True)
        assert len(seen) == 2 and seen[0].data_ptr() != seen[1].data_ptr()
        for g, want in zip(seen, grads):  # the first is not overwritten by the second replay
            torch.testing.assert_close(g, want)
    finally:
        hook.remove()


def test_make_graphed_callables_with_kwargs():
    torch.manual_seed(0)
    layer = te.TransformerLayer(HIDDEN, 2 * HIDDEN, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="arbitrary")
    mask = torch.rand(1, 1, 8, 8) > 0.5
    x = torch.randn(8, 2, HIDDEN)
    eager = layer(x, attention_mask=mask)
    graphed = te.make_graphed_callables(layer, (x,), sample_kwargs={"attention_mask": mask}, num_warmup_iters=1)
    torch.testing.assert_close(graphed(x, attention_mask=mask), eager, rtol=0, atol=0)


class _Grouped(torch.nn.Module):  # TE's _GroupedLinearWrapper: [s, b, h] tokens split evenly over the GEMMs
    def __init__(self, dtype):
        super().__init__()
        self.grouped_linear = te.GroupedLinear(2, HIDDEN, HIDDEN, params_dtype=dtype)

    def forward(self, x):
        s, b, h = x.shape
        return self.grouped_linear(x.reshape(s * b, h), [s * b // 2] * 2).reshape(s, b, h)


@pytest.mark.parametrize("module", ["grouped_linear", pytest.param("mha", marks=_SLOW)])
def test_make_graphed_callables_of_fp8_weights_replays_eager_bits(module):
    # FP8 weight parameters (quantized_model_init) inside the compiled graph: the weight's bytes are read as a plain
    # storage and its FP8 view made inside the traced autograd Function (TE's test_cuda_graphs fp8_params cases)
    recipe, dtype = Float8CurrentScaling(), torch.bfloat16

    def make():
        torch.manual_seed(3)
        with te.quantized_model_init(enabled=True, recipe=recipe):
            if module == "mha":
                return te.MultiheadAttention(HIDDEN, 2, attention_dropout=0.0, params_dtype=dtype,
                                             fuse_qkv_params=True)
            return _Grouped(dtype)

    def run(graphed):
        m = make()
        assert all(isinstance(p, te.Float8Tensor) for n, p in m.named_parameters() if "weight" in n
                   and "layer_norm" not in n)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(4, 2, HIDDEN, generator=g, dtype=dtype).requires_grad_()
        dy = torch.randn(4, 2, HIDDEN, generator=g, dtype=dtype)
        call = te.make_graphed_callables(m, (x.detach().clone().requires_grad_(),), num_warmup_iters=1,
                                         enabled=True, recipe=recipe) if graphed else m
        with te.autocast(enabled=True, recipe=recipe):
            y = call(x)
        y.backward(dy)
        return [y.detach(), x.grad] + [p.grad for p in m.parameters()]

    eager, graphed = run(False), run(True)
    assert all(g is not None for g in eager)
    for got, want in zip(graphed, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
