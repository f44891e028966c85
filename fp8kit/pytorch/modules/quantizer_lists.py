"""`module.quantizers`: Transformer Engine's per-module lists of quantizer objects, built from the module's last recipe.

TE keeps `{"scaling_fwd": [...], "scaling_bwd": [...]}` on every FP8 module, filled at the first FP8 forward (and
remade when the recipe type changes): per GEMM, three forward slots (input, weight, output: TE's `FP8FwdTensors`
order) and two backward ones (grad_output, grad_input: `FP8BwdTensors`), each a quantizer of the recipe's class.
fp8kit's modules cast through the recipe families' own quantizers (fp8kit.pytorch.recipe_families); these lists
are the same casts as TE's user-facing quantizer classes: under DelayedScaling a `Float8Quantizer` bound to the
slot's scale and amax in `fp8_meta` (it quantizes with the scale the module uses), under Float8CurrentScaling a
`Float8CurrentScalingQuantizer` with the role's QParams, under the block recipes the recipe's quantizer of the role.
The lists are tuples and the mapping is read-only: the module does not read them back, so a replaced entry would
change nothing.
"""

from __future__ import annotations

from types import MappingProxyType, SimpleNamespace

from ...recipe import DelayedScaling, Float8CurrentScaling
from ..cast import fp8_dtype_of
from ..fp8_weights import StateQuantizer
from ..recipe_families import FAMILIES
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer

__all__ = ["module_quantizers"]

_EMPTY = MappingProxyType({"scaling_fwd": (), "scaling_bwd": ()})


def module_quantizers(module) -> MappingProxyType:
    """The `quantizers` mapping of `module` (an FP8StateMixin) for its last FP8 forward's recipe; empty lists before
    the first one."""
    recipe = module.fp8_meta.get("recipe")
    if recipe is None:
        return _EMPTY
    n = module.num_gemms
    if isinstance(recipe, DelayedScaling):
        fwd_dtype, bwd_dtype = (fp8_dtype_of(name) for name in (recipe.fp8_format.value.fwd,
                                                                  recipe.fp8_format.value.bwd))
        fwd_state, bwd_state = module.fp8_meta.get("scaling_fwd"), module.fp8_meta.get("scaling_bwd")
        fwd = tuple(StateQuantizer(fwd_state, i, fwd_dtype) for i in range(3 * n)) if fwd_state is not None else ()
        bwd = tuple(StateQuantizer(bwd_state, i, bwd_dtype) for i in range(2 * n)) if bwd_state is not None else ()
    elif isinstance(recipe, Float8CurrentScaling):
        device = next((p.device for p in module.parameters()), None)
        fwd_dtype, bwd_dtype = (fp8_dtype_of(name) for name in (recipe.fp8_format.value.fwd,
                                                                  recipe.fp8_format.value.bwd))

        def current(dtype, q):
            return Float8CurrentScalingQuantizer(dtype, device, force_pow_2_scales=q.power_2_scale,
                                                 amax_epsilon=q.amax_epsilon)

        roles = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_fwd_inp)
        fwd = tuple(current(fwd_dtype, q) for _ in range(n) for q in roles)
        bwd = tuple(current(bwd_dtype, recipe.fp8_quant_bwd_grad) for _ in range(2 * n))
    else:  # a block family: its role quantizers need no state (input, weight, grad_output of any GEMM)
        call = SimpleNamespace(frame=SimpleNamespace(recipe=recipe), module=module, replay=False, record=None,
                               _states=None)
        fwd, bwd = [], []
        for gemm in range(n):
            inp, weight, grad = (getattr(q, "quantizer", q) for q in FAMILIES[type(recipe)].quantizers(call, gemm))
            for q in (inp, weight, grad):
                q.internal = False  # TE's lists make tensors (the modules' own casts make storages)
            fwd += [inp, weight, inp.copy()]
            bwd += [grad, grad.copy()]
        fwd, bwd = tuple(fwd), tuple(bwd)
    return MappingProxyType({"scaling_fwd": fwd, "scaling_bwd": bwd})
