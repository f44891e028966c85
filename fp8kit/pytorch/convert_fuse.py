"""convert_model(..., fuse_layernorm=...): a LayerNorm or RMSNorm whose output feeds only one Linear becomes one
`LayerNormLinear` (Transformer Engine's fused module), holding the same Parameter objects.

Which pairs:
- `fuse_layernorm=True`: inside every `torch.nn.Sequential` (exactly that type, whose forward feeds each module's
  output to the next one only), a norm immediately followed by a `torch.nn.Linear`.
- `fuse_layernorm={"norm name": "linear name", ...}`: exactly these pairs (fully qualified names as in
  `named_modules()`), anywhere in the model. The caller vouches that the norm's output goes to that Linear only:
  fp8kit cannot see a model's forward.
Norms: `torch.nn.LayerNorm` and `torch.nn.RMSNorm` over the last dimension with a weight (an RMSNorm needs a
numeric eps), and fp8kit's `LayerNorm` / `RMSNorm`. Linears: `torch.nn.Linear` (exactly that type) whose
in_features is the norm's size. `module_filter(linear, name)` False, or a shape FP8 GEMMs cannot take, leaves the
pair alone (the Linear is then treated as convert_model treats it).

The fused module replaces the Linear; the norm's place gets `torch.nn.Identity()`. It computes what the pair did:
the same norm (`F.layer_norm` / `F.rms_norm` with the same parameters; bf16 / fp16 norms computed in float32 as
Transformer Engine's, see modules/norm.py), then the same FP8 GEMM as a converted Linear, bit for bit. State dict
keys move to Transformer Engine's names: `<linear>.layer_norm_weight`, `<linear>.layer_norm_bias`, `<linear>.weight`,
`<linear>.bias`.
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Tuple, Union

import torch

from .modules import LayerNorm, LayerNormLinear, RMSNorm

__all__ = ["fuse_norm_linear_pairs", "norm_settings"]

FuseArg = Union[bool, Mapping[str, str]]


def norm_settings(norm: torch.nn.Module) -> Tuple[Optional[tuple], str]:
    """((normalization, size, eps, zero_centered_gamma), "") for a norm LayerNormLinear can take over, else
    (None, why not)."""
    if type(norm) in (torch.nn.LayerNorm, torch.nn.RMSNorm):
        kind = "LayerNorm" if type(norm) is torch.nn.LayerNorm else "RMSNorm"
        zero_centered = False
        if not norm.elementwise_affine:
            return None, f"{kind} without a weight (elementwise_affine=False)"
        if norm.eps is None:
            return None, "RMSNorm with eps=None (it depends on the input dtype)"
    elif type(norm) in (LayerNorm, RMSNorm):
        kind, zero_centered = type(norm).__name__, norm.zero_centered_gamma
    else:
        return None, f"{type(norm).__name__} is not a LayerNorm or RMSNorm"
    if len(norm.normalized_shape) != 1:
        return None, f"normalized_shape {tuple(norm.normalized_shape)} is not one dimension"
    return (kind, norm.normalized_shape[0], float(norm.eps), zero_centered), ""


def _keep(weight: torch.Tensor) -> None:
    """No initialisation: the meta-device placeholders are replaced by the pair's parameters."""


def _fused(norm: torch.nn.Module, settings: tuple, linear: torch.nn.Linear) -> LayerNormLinear:
    kind, _, eps, zero_centered = settings
    new = LayerNormLinear(linear.in_features, linear.out_features, eps=eps, bias=linear.bias is not None,
                          normalization=kind, zero_centered_gamma=zero_centered, device="meta",
                          params_dtype=linear.weight.dtype, init_method=_keep)
    new.layer_norm_weight = norm.weight  # the same Parameter objects: optimizers and ties keep working
    if kind == "LayerNorm":
        new.layer_norm_bias = getattr(norm, "bias", None)
    new.weight = linear.weight
    new.bias = linear.bias
    new.train(linear.training)
    return new


def _parent(model: torch.nn.Module, fqn: str) -> Tuple[torch.nn.Module, str]:
    parent_name, _, name = fqn.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), name


def _lookup(model: torch.nn.Module, fqn, role: str) -> torch.nn.Module:
    if not isinstance(fqn, str) or not fqn:
        raise TypeError(f"convert_model: fuse_layernorm maps norm names to Linear names (non-empty str), got {role} "
                        f"{fqn!r}")
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        raise ValueError(f"convert_model: fuse_layernorm names {role} {fqn!r}, which {type(model).__name__} does "
                         "not have") from None


def _sequential_pairs(model: torch.nn.Module) -> List[Tuple[str, str]]:
    pairs = []
    for seq_name, seq in model.named_modules():
        if type(seq) is not torch.nn.Sequential:
            continue
        children = list(seq._modules.items())  # in order, a module used twice included twice
        for (first, norm), (second, linear) in zip(children, children[1:]):
            settings, _ = norm_settings(norm) if norm is not None else (None, "")
            if settings is not None and type(linear) is torch.nn.Linear and linear.in_features == settings[1]:
                prefix = f"{seq_name}." if seq_name else ""
                pairs.append((prefix + first, prefix + second))
    return pairs


def _named_pairs(model: torch.nn.Module, mapping: Mapping[str, str]) -> List[Tuple[str, str]]:
    pairs, targets = [], set()
    for norm_name, linear_name in mapping.items():
        norm, linear = _lookup(model, norm_name, "the norm"), _lookup(model, linear_name, "the Linear")
        settings, why = norm_settings(norm)
        if settings is None:
            raise TypeError(f"convert_model: fuse_layernorm: {norm_name!r} cannot be fused: {why}")
        if type(linear) is not torch.nn.Linear:
            raise TypeError(f"convert_model: fuse_layernorm: {linear_name!r} is a {type(linear).__name__}, not a "
                            "torch.nn.Linear")
        if linear.in_features != settings[1]:
            raise ValueError(f"convert_model: fuse_layernorm: {norm_name!r} normalises {settings[1]} features but "
                             f"{linear_name!r} takes in_features={linear.in_features}")
        if linear_name in targets:
            raise ValueError(f"convert_model: fuse_layernorm: {linear_name!r} is named for two norms")
        targets.add(linear_name)
        pairs.append((norm_name, linear_name))
    return pairs


def fuse_norm_linear_pairs(model: torch.nn.Module, fuse_layernorm: FuseArg,
                           module_filter: Optional[Callable[[torch.nn.Module, str], bool]],
                           shape_problem: Callable[[int, int], Optional[str]]) -> List[Tuple[str, str]]:
    """Fuse the pairs `fuse_layernorm` selects (module docstring) in place; returns the (norm, linear) names fused.
    `shape_problem(in_features, out_features)` says why FP8 GEMMs cannot take a Linear (None if they can)."""
    if fuse_layernorm is False:
        return []
    if fuse_layernorm is True:
        pairs = _sequential_pairs(model)
    elif isinstance(fuse_layernorm, Mapping):
        pairs = _named_pairs(model, fuse_layernorm)
    else:
        raise TypeError(f"convert_model: fuse_layernorm must be a bool or a dict of norm name -> Linear name, got "
                        f"{fuse_layernorm!r}")
    fused = []
    for norm_name, linear_name in pairs:
        norm, linear = model.get_submodule(norm_name), model.get_submodule(linear_name)
        if module_filter is not None and not module_filter(linear, linear_name):
            continue
        if shape_problem(linear.in_features, linear.out_features):
            continue  # convert_model reports the Linear
        settings, _ = norm_settings(norm)
        parent, name = _parent(model, linear_name)
        setattr(parent, name, _fused(norm, settings, linear))
        parent, name = _parent(model, norm_name)
        setattr(parent, name, torch.nn.Identity())
        fused.append((norm_name, linear_name))
    return fused
