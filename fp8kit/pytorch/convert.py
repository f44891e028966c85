"""convert_model: swap torch.nn.Linear layers for fp8kit Linear in place, keeping the same parameters."""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Tuple

import torch

from .convert_fuse import FuseArg, fuse_norm_linear_pairs
from .modules import Linear


def fp8_shape_problem(in_features: int, out_features: int) -> Optional[str]:
    """Why FP8 GEMMs (on CUDA) cannot take a layer of this shape, or None if they can."""
    bad = [f"{name}={n} is not a multiple of 16" for name, n in
           (("in_features", in_features), ("out_features", out_features)) if n % 16]
    return "; ".join(bad) or None


def _to_fp8_linear(layer: torch.nn.Linear) -> Linear:
    new = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta",
                 params_dtype=layer.weight.dtype)
    new.weight = layer.weight  # the same Parameter objects: optimizers and ties keep working
    new.bias = layer.bias
    new.train(layer.training)
    return new


def convert_model(
    model: torch.nn.Module,
    module_filter: Optional[Callable[[torch.nn.Module, str], bool]] = None,
    *,
    fuse_layernorm: FuseArg = False,
) -> torch.nn.Module:
    """Replace every `torch.nn.Linear` (exactly that type) in `model` with an fp8kit Linear holding the same
    parameters, in place, and return `model`.

    module_filter: `f(module, fully_qualified_name) -> bool` (torchao's order); False leaves that layer alone.
    Layers whose shapes FP8 GEMMs cannot take (a feature dimension that is not a multiple of 16) are left as they
    are and reported in one warning; their names are also stored as `model.fp8kit_skipped` (a list of
    `(name, reason)`).

    fuse_layernorm (opt-in, default False): also replace LayerNorm / RMSNorm + Linear pairs by one
    `LayerNormLinear` with the same parameters: True fuses a norm directly followed by a Linear inside a
    `torch.nn.Sequential`; a dict `{norm_name: linear_name}` fuses exactly those pairs (the norm's output must feed
    that Linear only). The norm's place becomes `torch.nn.Identity()`; the fused pairs are listed in
    `model.fp8kit_fused`. See fp8kit.pytorch.convert_fuse for the rule.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_model: expected a torch.nn.Module, got {type(model).__name__}")
    skipped: List[Tuple[str, str]] = []
    if type(model) is torch.nn.Linear:
        raise TypeError("convert_model: pass a model that contains the Linear (it is replaced in its parent), "
                        "or build fp8kit.pytorch.Linear directly")
    if fuse_layernorm is not False:  # opt-in norm + Linear fusion (convert_fuse.py); the loop converts the rest
        model.fp8kit_fused = fuse_norm_linear_pairs(model, fuse_layernorm, module_filter, fp8_shape_problem)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            fqn = f"{parent_name}.{name}" if parent_name else name
            if module_filter is not None and not module_filter(child, fqn):
                continue
            problem = fp8_shape_problem(child.in_features, child.out_features)
            if problem:
                skipped.append((fqn, problem))
                continue
            setattr(parent, name, _to_fp8_linear(child))
    model.fp8kit_skipped = skipped
    if skipped:
        warnings.warn("convert_model left these layers in high precision, FP8 GEMMs cannot take their shapes: "
                      + ", ".join(f"{n} ({why})" for n, why in skipped), stacklevel=2)
    return model
