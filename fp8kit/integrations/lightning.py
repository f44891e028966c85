"""Lightning precision plugins for fp8kit: the counterpart of Lightning's `TransformerEnginePrecision`.

    import lightning as L
    from fp8kit.integrations.lightning import FP8Precision

    trainer = L.Trainer(plugins=[FP8Precision(fallback_compute_dtype=torch.bfloat16)], ...)

`FP8Precision` (for `lightning.pytorch.Trainer`) and `FabricFP8Precision` (for `lightning.fabric.Fabric`) convert
the model with `fp8kit.pytorch.convert_model` when the strategy sets it up (unless it holds fp8kit layers
already) and run every step (training, validation, test, predict) inside `fp8kit.pytorch.autocast(recipe)`, within
`torch.autocast(fallback_compute_dtype)` for the operations that stay in high precision, as Transformer Engine's
plugin does. Lightning restores a checkpoint's model state before the strategy's set-up, so to resume an FP8
checkpoint, convert the layers in the LightningModule (`__init__` or `configure_model`); see docs/integrations.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning_utilities import apply_to_collection

import fp8kit.pytorch as te
from fp8kit.pytorch.fp8_weights import default_dtype as _default_dtype
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe


def _recipe(recipe: Union[None, Recipe, Mapping]) -> Recipe:
    if recipe is None:
        return DelayedScaling()
    if isinstance(recipe, Mapping):  # as Transformer Engine's plugin: DelayedScaling keywords, fp8_format by name
        kwargs = dict(recipe)
        if isinstance(kwargs.get("fp8_format"), str):
            name = kwargs["fp8_format"]
            fp8 = [n for n in Format.__members__ if n != "E2M1"]  # E2M1 is FP4 (NVFP4 only)
            if name not in fp8:
                raise ValueError(f"FP8Precision: recipe['fp8_format'] must be one of {', '.join(fp8)}, got {name!r}")
            kwargs["fp8_format"] = Format[name]
        return DelayedScaling(**kwargs)
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"FP8Precision: recipe must be a DelayedScaling, Float8CurrentScaling, a dict of "
                        f"DelayedScaling keywords or None, got {recipe!r}")
    return recipe


def _to_float(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)


class FabricFP8Precision(FabricPrecision):
    """FP8 training with fp8kit for `lightning.fabric.Fabric(plugins=[...])`.

    Args (keyword only):
      weights_dtype: dtype of the parameters (default float32, master weights).
      recipe: DelayedScaling or Float8CurrentScaling, or a dict of DelayedScaling keywords (`fp8_format` may be a
        name); None is `DelayedScaling()`.
      replace_layers: None or True convert `torch.nn.Linear` and Hugging Face `Conv1D` layers with
        `fp8kit.pytorch.convert_model` (skipped, with a message, when the model holds fp8kit layers already);
        False never converts.
      fallback_compute_dtype: the `torch.autocast` dtype of everything that is not an FP8 GEMM; default
        `weights_dtype`; float32 means no torch.autocast.
      device_type: the device type of that torch.autocast; default "cuda" when CUDA is available, else "cpu".
      module_filter: passed to `convert_model`.
    """

    precision = "fp8kit"

    def __init__(self, *, weights_dtype: torch.dtype = torch.float32, recipe: Union[None, Recipe, Mapping] = None,
                 replace_layers: Optional[bool] = None, fallback_compute_dtype: Optional[torch.dtype] = None,
                 device_type: Optional[str] = None,
                 module_filter: Optional[Callable[[torch.nn.Module, str], bool]] = None) -> None:
        for name, value in (("weights_dtype", weights_dtype), ("fallback_compute_dtype", fallback_compute_dtype)):
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"FP8Precision: {name} must be a floating torch.dtype, got {value!r}")
        if replace_layers not in (None, True, False):
            raise TypeError(f"FP8Precision: replace_layers must be None or a bool, got {replace_layers!r}")
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"FP8Precision: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.weights_dtype = weights_dtype
        self.recipe = _recipe(recipe)
        self.replace_layers = replace_layers
        self.fallback_compute_dtype = fallback_compute_dtype or weights_dtype
        self.device_type = device_type
        self.module_filter = module_filter

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Convert the layers (see `replace_layers`) and cast the parameters to `weights_dtype`."""
        if any(hasattr(m, "fp8_meta") for m in module.modules()):
            if self.replace_layers:
                rank_zero_info(f"FP8Precision(replace_layers=True): {type(module).__name__} holds fp8kit layers "
                               "already; not converting it again")
        elif self.replace_layers in (None, True):
            te.convert_model(module, self.module_filter)
        return module.to(dtype=self.weights_dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.weights_dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.weights_dtype)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Default dtype `weights_dtype`, torch.autocast(fallback_compute_dtype) unless float32, fp8kit autocast."""
        stack = contextlib.ExitStack()
        stack.enter_context(_default_dtype(self.weights_dtype))
        if self.fallback_compute_dtype != torch.float32:
            stack.enter_context(torch.autocast(self.device_type, dtype=self.fallback_compute_dtype))
        stack.enter_context(te.autocast(enabled=True, recipe=self.recipe))
        return stack

    def convert_input(self, data: Any) -> Any:
        return _to_float(data, self.weights_dtype)

    def convert_output(self, data: Any) -> Any:
        return _to_float(data, torch.get_default_dtype())


class FP8Precision(TrainerPrecision, FabricFP8Precision):
    """FP8 training with fp8kit for `lightning.pytorch.Trainer(plugins=[...])`; arguments as FabricFP8Precision."""
