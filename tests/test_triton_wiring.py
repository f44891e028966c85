"""The kernels wired into fp8kit: the quantizers' `transpose` and `quantize_dbias` and a Linear's training steps
give the same bytes, histories, scales and gradients through the kernels as through the torch path.

CPU cases run the kernels in Triton's interpreter inside `host.tensor_path()` (the CPU fast path would bypass
them). The data lie on a coarse dyadic grid and the scales are powers of two, so no cast rounds (the interpreter's
mis-rounding cannot show) and every sum is exact in float32: the results must agree bit for bit."""

import contextlib

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from triton_helpers import E4M3, E5M2, assert_transpose, bits, dev_fixture, grid_values  # noqa: E402,F401

import fp8kit.pytorch as te  # noqa: E402
from fp8kit.pytorch import host, kernels  # noqa: E402
from fp8kit.pytorch.quantizer import CurrentQuantizer, DelayedQuantizer  # noqa: E402
from fp8kit.pytorch.state import ScalingState  # noqa: E402
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402


def _quantizers(kind, dev):
    if kind == "delayed":
        state = ScalingState(3, 4, dev)
        state.scale.copy_(torch.tensor([4.0, 0.5, 8.0]))
        return DelayedQuantizer(state, 2, E5M2), state
    return CurrentQuantizer(E5M2, power_2=True), None


@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_quantizer_transpose_and_dbias_match_torch_path(dev, kind):
    dy = grid_values((96, 40), seed=1, device=dev).to(torch.bfloat16)
    results = {}
    for name in ("torch", "kernels"):
        q, state = _quantizers(kind, dev)
        kernels.set_enabled(name == "kernels")
        try:
            with host.tensor_path():
                fp8, dbias = q.quantize_dbias(dy)
                x8 = q.quantize(dy[:, :32].contiguous(), transpose=True)
        finally:
            kernels.set_enabled(None)
        results[name] = (fp8, dbias, x8, None if state is None else state.amax_history.clone())
    (a, da, xa, ha), (b, db, xb, hb) = results["torch"], results["kernels"]
    assert torch.equal(bits(a.data), bits(b.data)) and torch.equal(bits(a.scale_inv), bits(b.scale_inv))
    assert torch.equal(bits(xa.data), bits(xb.data))
    assert torch.equal(bits(da), bits(db)) and db.dtype == torch.bfloat16
    assert torch.equal(bits(db), bits(dy.float().sum(0).to(torch.bfloat16)))
    assert_transpose(b.data, b.data_t)
    assert_transpose(xb.data, xb.data_t)
    if dev != "cpu":  # the torch path makes data_t only off the CPU (the emulated GEMM reads any layout)
        assert_transpose(a.data, a.data_t)
    if ha is not None:
        assert torch.equal(bits(ha), bits(hb)) and hb[0, 2].item() == 2.0


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_linear_steps_through_the_kernels_match_the_default_path(dev, recipe_name, monkeypatch):
    """With the kernels enabled (`kernels.set_enabled(True)` on the torch-operation path), a Linear's training steps
    leave the same histories and scales as the default path, and the same gradients."""
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4, power_2_scale=True) \
        if recipe_name == "delayed" else Float8CurrentScaling(fp8_format=Format.HYBRID, use_power_2_scales=True)
    x, w = grid_values((32, 48), 1, dev), grid_values((64, 48), 2, dev)
    dys = [grid_values((32, 64), 3 + i, dev) for i in range(3)]
    calls = []
    for fn in ("cast_amax", "current_cast", "update_tensors", "cast_transpose_dbias", "current_cast_transpose_dbias"):
        def counted(*args, _fn=getattr(kernels, fn), _name=fn, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(kernels, fn, counted)
    runs = {}
    for name in ("default", "kernels"):
        layer = te.Linear(48, 64, bias=False, device=dev)
        with torch.no_grad():
            layer.weight.copy_(w)
        xi = x.clone().requires_grad_()
        kernels.set_enabled(name == "kernels")
        try:
            with host.tensor_path() if name == "kernels" else contextlib.nullcontext():
                for dy in dys:
                    with te.autocast(recipe=recipe):
                        y = layer(xi)
                    y.backward(dy)
        finally:
            kernels.set_enabled(None)
        runs[name] = (layer, y, xi.grad, layer.weight.grad)
    (a, ya, dxa, dwa), (b, yb, dxb, dwb) = runs["default"], runs["kernels"]
    # per step: the input, weight and grad_output casts (grad_output through the dbias kernel once Linear asks for
    # it), and with delayed scaling two batched updates
    casts = [c for c in calls if c != "update_tensors"]
    assert len(casts) == 9 and calls.count("update_tensors") == (6 if recipe_name == "delayed" else 0)
    if recipe_name == "delayed":
        for which in ("scaling_fwd", "scaling_bwd"):
            sa, sb = a.fp8_meta[which], b.fp8_meta[which]
            assert torch.equal(bits(sa.amax_history), bits(sb.amax_history)), which
            assert torch.equal(bits(sa.scale), bits(sb.scale)), which
    assert torch.equal(ya, yb) and torch.equal(dxa, dxb) and torch.equal(dwa, dwb)
