"""convert_model: swap torch.nn.Linear layers (and the layer types integrations register) for fp8kit modules in
place, keeping the same parameters."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .convert_fuse import FuseArg, fuse_norm_linear_pairs
from .modules import Linear


@dataclass(frozen=True)
class LayerConverter:
    """How `convert_model` replaces one exact layer type: `features(layer) -> (in, out)` for the FP8 shape check,
    `convert(layer) -> module` holding the same Parameter objects, `name` for messages."""

    features: Callable[[torch.nn.Module], Tuple[int, int]]
    convert: Callable[[torch.nn.Module], torch.nn.Module]
    name: str


# The layer types convert_model replaces, by exact type. torch.nn.Linear is the core's own entry; optional
# integrations add theirs when they are imported (fp8kit.integrations.hf_conv1d: Hugging Face's Conv1D). The core
# imports no integration.
_CONVERTERS: Dict[type, LayerConverter] = {}

# Layer types an integration knows how to convert, found by (module, class name) without importing their library:
# a model holding one whose converter is not registered gets a warning saying which module to import.
_KNOWN_ELSEWHERE: Dict[Tuple[str, str], str] = {
    ("transformers.pytorch_utils", "Conv1D"): "fp8kit.integrations.hf_conv1d",
}


def register_converter(layer_type: type, features: Callable[[torch.nn.Module], Tuple[int, int]],
                       convert: Callable[[torch.nn.Module], torch.nn.Module], name: str) -> None:
    """Let `convert_model` replace layers of exactly `layer_type` (an integration calls this when imported).

    features: `layer -> (in_features, out_features)`; convert: `layer -> new module` keeping the same Parameter
    objects (optimizers and ties keep working); name: how warnings name the type."""
    if not isinstance(layer_type, type) or not issubclass(layer_type, torch.nn.Module):
        raise TypeError(f"register_converter: expected a torch.nn.Module subclass, got {layer_type!r}")
    if not callable(features) or not callable(convert):
        raise TypeError("register_converter: features and convert must be callables taking the layer")
    _CONVERTERS[layer_type] = LayerConverter(features, convert, name)


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


register_converter(torch.nn.Linear, lambda layer: (layer.in_features, layer.out_features), _to_fp8_linear,
                   "torch.nn.Linear")


def _unregistered(module: torch.nn.Module) -> Optional[str]:
    """The integration module that would convert `module`'s type, when that type is known but not registered."""
    kind = type(module)
    if kind in _CONVERTERS:
        return None
    return _KNOWN_ELSEWHERE.get((kind.__module__, kind.__qualname__))


def _nothing_converted_reason(model: torch.nn.Module, filtered: List[str], skipped) -> str:
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
        reasons.append("it holds no " + " or ".join(c.name for c in _CONVERTERS.values()))
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
    """Replace, in place, every `torch.nn.Linear` (exactly that type) in `model` with an fp8kit Linear, and every
    layer of a type an imported integration registered (`register_converter`; `import fp8kit.integrations.hf_conv1d`
    adds Hugging Face's `transformers.pytorch_utils.Conv1D`, GPT-2's layers) with its fp8kit module, each holding the
    same Parameter objects under the same names and layouts; return `model`. A layer of a type an integration
    would convert, left alone because that integration is not imported, gets a warning naming the import.

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
    if type(model) in _CONVERTERS:
        raise TypeError(f"convert_model: pass a model that contains the {type(model).__name__} (it is replaced in "
                        "its parent), or build the fp8kit module directly")
    skipped: List[Tuple[str, str]] = []
    filtered: List[str] = []
    unregistered: Dict[str, List[str]] = {}
    converted = 0
    if fuse_layernorm is not False:  # opt-in norm + Linear fusion (convert_fuse.py); the loop converts the rest
        model.fp8kit_fused = fuse_norm_linear_pairs(model, fuse_layernorm, module_filter, fp8_shape_problem)
        converted += len(model.fp8kit_fused)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            fqn = f"{parent_name}.{name}" if parent_name else name
            converter = _CONVERTERS.get(type(child))
            if converter is None:
                integration = _unregistered(child)
                if integration is not None:
                    unregistered.setdefault(integration, []).append(fqn)
                continue
            if module_filter is not None and not module_filter(child, fqn):
                filtered.append(fqn)
                continue
            problem = fp8_shape_problem(*converter.features(child))
            if problem:
                skipped.append((fqn, problem))
                continue
            setattr(parent, name, converter.convert(child))
            converted += 1
    model.fp8kit_skipped = skipped
    if skipped:
        warnings.warn("convert_model left these layers in high precision, FP8 GEMMs cannot take their shapes: "
                      + ", ".join(f"{n} ({why})" for n, why in skipped), stacklevel=2)
    for integration, names in unregistered.items():
        warnings.warn(f"convert_model left {len(names)} layers alone that {integration} converts ("
                      + ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                      + f"): import {integration} before convert_model to convert them", stacklevel=2)
    if not converted:
        warnings.warn(f"convert_model converted no layer of {type(model).__name__}: "
                      + _nothing_converted_reason(model, filtered, skipped), stacklevel=2)
    return model
