"""Our port of Transformer Engine's tests/pytorch/test_grouped_linear.py for the per-tensor recipes: GroupedLinear
equals one Linear per split bit for bit (outputs, input and weight gradients), with empty splits, bias, FP8 weights,
main_grad accumulation and delayed wgrad; Fp8Padding / Fp8Unpadding around it equal the unpadded layer."""

import pytest
import torch
from torch.nn import Parameter

import fp8kit.pytorch as te
from fp8kit.pytorch.quantization import get_align_size_for_quantization
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = {"none": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling()}
SEQ, BS, HIDDEN = 64, 2, 32


def _splits(num_gemms, recipe, seed):
    """Random split sizes (one of them empty when there are three or more) in multiples of the recipe's alignment."""
    align = get_align_size_for_quantization(recipe) if recipe is not None else 1
    g = torch.Generator().manual_seed(seed)
    m = SEQ // align
    cuts = torch.sort(torch.randint(0, m, (num_gemms - 2,), generator=g)).values.tolist() if num_gemms > 1 else []
    if num_gemms > 1:
        cuts.append(cuts[-1] if cuts else 0)  # an empty split
    bounds = [0] + cuts + [m]
    return [(b - a) * align * BS for a, b in zip(bounds[:-1], bounds[1:])]


def _run(block, splits, recipe, fuse, delay):
    torch.manual_seed(7)
    x = torch.randn(SEQ * BS, HIDDEN, requires_grad=True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        if isinstance(block, te.GroupedLinear):
            out = block(x, splits)
        else:
            out = torch.cat([lin(part) for lin, part in zip(block, torch.split(x, splits))])
    out.sum().backward()
    if delay:
        if isinstance(block, te.GroupedLinear):
            block.backward_dw()
        else:
            for lin in block:
                lin.backward_dw()
    grads = []
    for p in block.parameters():
        if fuse and getattr(p, "main_grad", None) is not None:
            assert p.grad is None
            grads.append(p.main_grad)
        else:
            grads.append(p.grad)
    return [out, x.grad] + grads


@pytest.mark.parametrize("recipe,num_gemms,bias,fp8_weights,fuse,delay", [
    ("none", 3, True, False, False, False),
    ("delayed", 3, False, False, True, False),
    ("current", 4, True, False, False, True),
    ("delayed", 1, True, True, False, False),
    ("current", 3, False, True, False, False),
    ("current", 2, True, False, True, True),
])
def test_grouped_linear_matches_sequential_linears(recipe, num_gemms, bias, fp8_weights, fuse, delay):
    r = RECIPES[recipe]
    with te.quantized_model_init(enabled=fp8_weights, recipe=r):
        grouped = te.GroupedLinear(num_gemms, HIDDEN, 4 * HIDDEN, bias=bias, fuse_wgrad_accumulation=fuse,
                                   delay_wgrad_compute=delay)
        sequential = torch.nn.ModuleList([te.Linear(HIDDEN, 4 * HIDDEN, bias=bias, fuse_wgrad_accumulation=fuse,
                                                    delay_wgrad_compute=delay) for _ in range(num_gemms)])
    with torch.no_grad():
        for i, lin in enumerate(sequential):
            lin.weight = Parameter(getattr(grouped, f"weight{i}").clone())
            if bias:
                lin.bias = Parameter(getattr(grouped, f"bias{i}").clone())
            if fuse:
                w = getattr(grouped, f"weight{i}")
                w.main_grad = torch.rand(w.shape)
                lin.weight.main_grad = w.main_grad.clone()
    splits = _splits(num_gemms, r, seed=num_gemms)
    assert sum(splits) == SEQ * BS
    for got, want in zip(_run(grouped, splits, r, fuse, delay), _run(sequential, splits, r, fuse, delay)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_grouped_linear_high_precision_matches_float64():
    torch.manual_seed(0)
    grouped = te.GroupedLinear(3, HIDDEN, 16)
    x = torch.randn(40, HIDDEN, dtype=torch.float64)
    splits = [16, 0, 24]
    out = grouped(x.float(), splits).double()
    parts = torch.split(x, splits)
    expected = torch.cat([p @ getattr(grouped, f"weight{i}").double().T + getattr(grouped, f"bias{i}").double()
                          for i, p in enumerate(parts)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_padding_grouped_linear_matches_unpadded(recipe):
    # splits of any size, padded to the FP8 alignment with zero rows, through GroupedLinear and back
    r = RECIPES[recipe]
    splits = [5, 0, 19]
    torch.manual_seed(2)
    grouped = te.GroupedLinear(3, HIDDEN, 48, bias=False)
    x = torch.randn(sum(splits), HIDDEN, requires_grad=True)
    pad, unpad = te.Fp8Padding(3), te.Fp8Unpadding(3)
    # the padding rows are zeros: each real row equals the same layer run on the input padded by hand (in the same
    # autocast step, so that delayed scaling uses the same scales)
    pieces, start = [], 0
    for s, ps in zip(splits, [16, 0, 32]):
        pieces += [x.detach()[start:start + s], torch.zeros(ps - s, HIDDEN)]
        start += s
    with te.autocast(recipe=r):
        padded, padded_splits = pad(x, splits)
        out = unpad(grouped(padded, padded_splits), splits)
        ref_out = grouped(torch.cat(pieces), [16, 0, 32])
    assert padded_splits == [16, 0, 32] and padded.shape[0] == 48
    assert out.shape == (sum(splits), 48)
    keep = torch.cat([torch.arange(s) + off for s, off in zip(splits, [0, 16, 16])])
    torch.testing.assert_close(out, ref_out[keep], rtol=0, atol=0)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()


def test_no_caller_output_buffers():
    # TE's newer `out` / `dgrad_out` preallocated buffers are not accepted (docs/pytorch.md, differences)
    layer = te.GroupedLinear(2, 16, 8)
    with pytest.raises(TypeError, match="out"):
        layer(torch.randn(8, 16), [4, 4], out=torch.empty(8, 8))
