"""The recipe plug-in seam (docs/architecture.md, "Adding a recipe"): a new recipe family is a recipe class, a family
registered with `register_recipe_family` (its quantizers by role), a storage class and a GEMM rule registered with
`register_gemm_rule`. Here a toy family (every tensor cast with scale 1, its own storage type) runs through Linear,
LayerNormMLP and GroupedLinear without any of them knowing it; the numbers are checked against the NumPy oracle.
"""

import dataclasses

import numpy as np
import pytest
import torch

import fp8kit.pytorch as te
from fp8kit.pytorch import gemm as gemm_module
from fp8kit.pytorch import recipe_families
from fp8kit.pytorch.cast import cast
from fp8kit.pytorch.tensor.storage import Float8TensorStorage
from fp8kit.recipe import Format, Recipe

from reference import cast as ref_cast
from reference import dequantize as ref_dequantize


@dataclasses.dataclass(frozen=True)
class UnitScaling(Recipe):
    """A toy family: every tensor cast with scale 1 (E4M3 forward, E5M2 backward)."""

    fp8_format: Format = Format.HYBRID
    override_linear_precision: tuple = (False, False, False)


class UnitStorage(Float8TensorStorage):
    """The toy family's storage: per-tensor bytes, but its own type, so the GEMM must dispatch on it."""

    def transposed(self) -> "UnitStorage":
        t = super().transposed()
        return UnitStorage(data=t._data, fp8_scale_inv=t._scale_inv, fp8_dtype=t._fp8_dtype, fake_dtype=t._dtype)

    @staticmethod
    def from_saved(data, scale_inv, scale_inv_value) -> "UnitStorage":
        return UnitStorage(data=data, fp8_scale_inv=scale_inv)


class UnitQuantizer:
    stats = None

    def __init__(self, fp8_dtype):
        self.fp8_dtype = fp8_dtype

    def quantize(self, x, transpose=False):
        q = cast(x, torch.ones((), dtype=torch.float32), self.fp8_dtype)
        return UnitStorage(data=q._data, fp8_scale_inv=q._scale_inv, fp8_dtype=q._fp8_dtype, fake_dtype=x.dtype)

    def quantize_dbias(self, dy):
        return self.quantize(dy, transpose=True), dy.reshape(-1, dy.shape[-1]).sum(0)

    def observe(self, x):
        pass


@pytest.fixture
def unit_family(monkeypatch):
    """Register the toy family and its GEMM rule for one test; returns the log of the GEMM rule's operands."""
    for table in (recipe_families.FAMILIES, gemm_module._RULES):  # registrations undone after the test
        monkeypatch.setattr(table, "_own", dict(table._own))
        table.clear()
    made, multiplied = [], []

    def quantizers(call, gemm):
        made.append(gemm)
        return UnitQuantizer(torch.float8_e4m3fn), UnitQuantizer(torch.float8_e4m3fn), \
            UnitQuantizer(torch.float8_e5m2)

    def rule(a, b, out_dtype, bias, use_fast_accum):
        multiplied.append((type(a), type(b)))
        return gemm_module.per_tensor_gemm(a, b, out_dtype, bias, use_fast_accum)

    recipe_families.register_recipe_family(UnitScaling, quantizers)
    gemm_module.register_gemm_rule(UnitStorage, rule)
    yield made, multiplied
    for table in (recipe_families.FAMILIES, gemm_module._RULES):
        table.clear()  # forget the lookups resolved while the toy family was registered


def _q(t: torch.Tensor, fmt: str) -> np.ndarray:
    """The oracle's FP8 value of `t` cast with scale 1, in float64."""
    q, inv = ref_cast(t.detach().numpy(), fmt, 1.0)
    return ref_dequantize(q, fmt, inv).astype(np.float64)


def test_a_new_family_runs_through_linear_without_editing_it(unit_family):
    made, multiplied = unit_family
    torch.manual_seed(0)
    layer = te.Linear(32, 16, bias=False)
    x = torch.randn(8, 32, requires_grad=True)
    dy = torch.randn(8, 16)
    with te.autocast(recipe=UnitScaling()):
        y = layer(x)
    y.backward(dy)
    xq, wq, dyq = _q(x, "e4m3"), _q(layer.weight, "e4m3"), _q(dy, "e5m2")
    np.testing.assert_allclose(y.detach().numpy(), xq @ wq.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), dyq @ wq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.weight.grad.numpy(), dyq.T @ xq, rtol=1e-5, atol=1e-5)
    assert made == [0]
    assert multiplied == [(UnitStorage, UnitStorage)] * 3  # fprop, dgrad, wgrad all through the family's rule


def test_a_new_family_runs_through_the_multi_gemm_modules(unit_family):
    made, multiplied = unit_family
    mlp = te.LayerNormMLP(32, 64)
    grouped = te.GroupedLinear(2, 32, 16)
    x = torch.randn(6, 32, requires_grad=True)
    with te.autocast(recipe=UnitScaling()):
        out = mlp(x).sum() + grouped(x, [2, 4]).sum()
    out.backward()
    assert sorted(made) == [0, 0, 1, 1] and len(multiplied) == 4 * 3
    assert set(multiplied) == {(UnitStorage, UnitStorage)}


def test_an_unregistered_recipe_and_mixed_operands_are_refused(unit_family):
    @dataclasses.dataclass(frozen=True)
    class Unknown(Recipe):
        fp8_format: Format = Format.HYBRID

    with pytest.raises(TypeError, match="recipe must be a fp8kit.recipe DelayedScaling or Float8CurrentScaling or "
                                        ".*UnitScaling, got"):
        with te.autocast(recipe=Unknown()):
            pass
    with pytest.raises(TypeError, match="no recipe family is registered for Unknown"):
        recipe_families.recipe_family(Unknown)
    a = UnitQuantizer(torch.float8_e4m3fn).quantize(torch.ones(4, 4))
    b = cast(torch.ones(4, 4), torch.ones((), dtype=torch.float32), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="UnitStorage and Float8TensorStorage have different GEMM rules"):
        gemm_module.gemm(a, b, torch.float32)
    with pytest.raises(TypeError, match="no GEMM rule is registered for Tensor"):
        gemm_module.gemm(torch.ones(2, 2), torch.ones(2, 2), torch.float32)
    with pytest.raises(TypeError, match="subclass of fp8kit.recipe.Recipe"):
        recipe_families.register_recipe_family(int, lambda call, gemm: None)


def test_the_builtin_families_are_registered_once():
    """Delayed and current scaling go through the same table (a subclass finds its base class's family)."""
    from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

    assert recipe_families.registered_recipes()[:2] == (DelayedScaling, Float8CurrentScaling)

    class MyDelayed(DelayedScaling):  # recipes are mutable dataclasses: a subclass need not be a dataclass
        pass

    assert recipe_families.recipe_family(MyDelayed) is recipe_families.recipe_family(DelayedScaling)
    assert gemm_module.gemm_rule(te.Float8Tensor) is gemm_module.per_tensor_gemm
