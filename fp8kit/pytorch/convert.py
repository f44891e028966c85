"""convert_model: swap torch.nn.Linear (and Hugging Face's Conv1D) layers for fp8kit modules in place, keeping the
same parameters."""

from __future__ import annotations

import sys
import warnings
from typing import Callable, List, Optional, Tuple

import torch

from .convert_fuse import FuseArg, fuse_norm_linear_pairs
from .modules import Linear

# Hugging Face's Conv1D (GPT-2 and others): a Linear with its weight stored [in, out]. Recognised without importing
# transformers: a model holding one has imported it already.
_HF_CONV1D_MODULE = "transformers.pytorch_utils"


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


def _hf_conv1d_class():
    module = sys.modules.get(_HF_CONV1D_MODULE)
    return getattr(module, "Conv1D", None) if module is not None else None


def _kind(module: torch.nn.Module, hf_conv1d) -> Optional[str]:
    """"linear" or "conv1d" for the exact types convert_model replaces, None otherwise."""
    if type(module) is torch.nn.Linear:
        return "linear"
    if hf_conv1d is not None and type(module) is hf_conv1d:
        return "conv1d"
    return None


def _features(module: torch.nn.Module, kind: str) -> Tuple[int, int]:
    return (module.in_features, module.out_features) if kind == "linear" else (module.nx, module.nf)


def _convert(module: torch.nn.Module, kind: str) -> torch.nn.Module:
    if kind == "linear":
        return _to_fp8_linear(module)
    from fp8kit.integrations.hf_conv1d import Conv1D

    return Conv1D.from_hf(module)


def _nothing_converted_reason(model: torch.nn.Module, filtered: List[str], skipped, hf_conv1d) -> str:
    fp8 = [n for n, m in model.named_modules() if hasattr(m, "fp8_meta")]
    others = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)
                     and type(m) is not torch.nn.Linear and not hasattr(m, "fp8_meta")})
    reasons = []
    if filtered:
        reasons.append(f"module_filter rejected {len(filtered)} ({', '.join(filtered[:5])}"
                       f"{', ...' if len(filtered) > 5 else ''})")
    if skipped:
        reasons.append(f"{len(skipped)} have shapes FP8 GEMMs cannot take")
    if not filtered and not skipped:
        reasons.append("it holds no torch.nn.Linear" + (" or transformers Conv1D" if hf_conv1d is not None else ""))
    if fp8:
        reasons.append(f"it already holds {len(fp8)} fp8kit layers (converted before?)")
    if others:
        reasons.append("subclasses of torch.nn.Linear are left alone (" + ", ".join(others) + ")")
    return "; ".join(reasons)


def convert_model(
    model: torch.nn.Module,
    module_filter: Optional[Callable[[torch.nn.Module, str], bool]] = None,
    *,
    fuse_layernorm: FuseArg = False,
) -> torch.nn.Module:
    """Replace, in place, every `torch.nn.Linear` (exactly that type) in `model` with an fp8kit Linear and every
    Hugging Face `transformers.pytorch_utils.Conv1D` (GPT-2's layers, weight stored `[in, out]`) with
    `fp8kit.integrations.hf_conv1d.Conv1D`, each holding the same Parameter objects under the same names and
    layouts; return `model`.

    module_filter: `f(module, fully_qualified_name) -> bool` (torchao's order); False leaves that layer alone.
    Layers whose shapes FP8 GEMMs cannot take (a feature dimension that is not a multiple of 16) are left as they
    are and reported in one warning; their names are also stored as `model.fp8kit_skipped` (a list of
    `(name, reason)`). Converting nothing at all warns too, saying why.

    fuse_layernorm (opt-in, default False): also replace LayerNorm / RMSNorm + Linear pairs by one
    `LayerNormLinear` with the same parameters: True fuses a norm directly followed by a Linear inside a
    `torch.nn.Sequential`; a dict `{norm_name: linear_name}` fuses exactly those pairs (the norm's output must feed
    that Linear only). The norm's place becomes `torch.nn.Identity()`; the fused pairs are listed in
    `model.fp8kit_fused`. See fp8kit.pytorch.convert_fuse for the rule.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_model: expected a torch.nn.Module, got {type(model).__name__}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"convert_model: module_filter must be callable f(module, name) -> bool, "
                        f"got {module_filter!r}")
    hf_conv1d = _hf_conv1d_class()
    if _kind(model, hf_conv1d) is not None:
        raise TypeError(f"convert_model: pass a model that contains the {type(model).__name__} (it is replaced in "
                        "its parent), or build the fp8kit module directly")
    skipped: List[Tuple[str, str]] = []
    filtered: List[str] = []
    converted = 0
    if fuse_layernorm is not False:  # opt-in norm + Linear fusion (convert_fuse.py); the loop converts the rest
        model.fp8kit_fused = fuse_norm_linear_pairs(model, fuse_layernorm, module_filter, fp8_shape_problem)
        converted += len(model.fp8kit_fused)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            kind = _kind(child, hf_conv1d)
            if kind is None:
                continue
            fqn = f"{parent_name}.{name}" if parent_name else name
            if module_filter is not None and not module_filter(child, fqn):
                filtered.append(fqn)
                continue
            problem = fp8_shape_problem(*_features(child, kind))
            if problem:
                skipped.append((fqn, problem))
                continue
            setattr(parent, name, _convert(child, kind))
            converted += 1
    model.fp8kit_skipped = skipped
    if skipped:
        warnings.warn("convert_model left these layers in high precision, FP8 GEMMs cannot take their shapes: "
                      + ", ".join(f"{n} ({why})" for n, why in skipped), stacklevel=2)
    if not converted:
        warnings.warn(f"convert_model converted no layer of {type(model).__name__}: "
                      + _nothing_converted_reason(model, filtered, skipped, hf_conv1d), stacklevel=2)
    return model
