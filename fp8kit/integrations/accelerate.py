"""FP8 with Hugging Face `accelerate` and `transformers.Trainer`, without Transformer Engine.

`Accelerator(mixed_precision="fp8")` needs Transformer Engine (or MS-AMP, torchao) installed; with it, accelerate
converts the model's Linear layers and wraps the model's forward in `fp8_autocast`, enabled while the model is in
training mode. `prepare_model` does the same with fp8kit; the rest of the set-up is accelerate's bf16 one:

    from fp8kit.integrations.accelerate import prepare_model

    model = prepare_model(model)                          # convert_model + forward under fp8kit autocast
    accelerator = Accelerator(mixed_precision="bf16")     # bf16 autocast around everything else
    model, optimizer = accelerator.prepare(model, optimizer)

With `transformers.Trainer`, prepare the model before building the Trainer and set `bf16=True` in
`TrainingArguments`. Evaluation (`model.eval()`) runs outside FP8 unless `use_during_eval=True`, as accelerate's
`use_autocast_during_eval`. See docs/integrations.md.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch

import fp8kit.pytorch as te
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe

#: accelerate's default Transformer Engine recipe (`TERecipeKwargs()`): HYBRID, history 1024, "most_recent".
ACCELERATE_DEFAULT_RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024,
                                           amax_compute_algo="most_recent")


class FP8Forward:
    """What `prepare_model` puts in `model.forward`: the model's own forward, run inside
    `fp8kit.pytorch.autocast(enabled=use_during_eval or model.training, recipe=recipe)`.

    Attributes `recipe` and `use_during_eval` may be changed later. Copies of the model (deepcopy, pickle) get
    their own FP8Forward bound to the copy.
    """

    def __init__(self, module: torch.nn.Module, recipe: Recipe, use_during_eval: bool):
        self.module = module
        self.recipe = recipe
        self.use_during_eval = use_during_eval
        # An instance-level forward set before (another wrapper) runs inside; otherwise the class's forward.
        self.inner: Optional[Callable] = module.__dict__.get("forward")

    def _forward(self) -> Callable:
        module = self.module
        return self.inner if self.inner is not None else type(module).forward.__get__(module)

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own forward signature (Trainer reads it to keep the dataset columns the model takes)."""
        return inspect.signature(self._forward())

    def __call__(self, *args, **kwargs):
        module = self.module
        if args and args[0] is module:  # called as MethodType(self, module) (accelerate's unwrap_model does that)
            args = args[1:]
        with te.autocast(enabled=self.use_during_eval or module.training, recipe=self.recipe):
            return self._forward()(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"FP8Forward({type(self.module).__name__}, recipe={self.recipe!r}, "
                f"use_during_eval={self.use_during_eval})")


def prepare_model(model: torch.nn.Module, recipe: Optional[Recipe] = None, *, use_during_eval: bool = False,
                  module_filter: Optional[Callable[[torch.nn.Module, str], bool]] = None,
                  convert: bool = True) -> torch.nn.Module:
    """Make `model` train in FP8 under accelerate / Trainer, in place; return it.

    recipe: an fp8kit DelayedScaling or Float8CurrentScaling; None is `ACCELERATE_DEFAULT_RECIPE`, the recipe
      accelerate builds for Transformer Engine by default.
    use_during_eval: also run FP8 while `model.training` is False (accelerate's `use_autocast_during_eval`).
    module_filter: passed to `fp8kit.pytorch.convert_model` (False keeps a layer in high precision).
    convert: False leaves the layers alone (the model holds fp8kit layers already) and only wraps the forward.

    Call it before `accelerator.prepare` (or before building the Trainer), once per model.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model: model must be a torch.nn.Module, got {type(model).__name__}")
    if recipe is None:
        recipe = ACCELERATE_DEFAULT_RECIPE
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"prepare_model: recipe must be a fp8kit.recipe.DelayedScaling or Float8CurrentScaling, "
                        f"got {recipe!r}")
    if not isinstance(use_during_eval, bool):
        raise TypeError(f"prepare_model: use_during_eval must be a bool, got {use_during_eval!r}")
    if isinstance(model.__dict__.get("forward"), FP8Forward):
        raise ValueError(f"prepare_model: {type(model).__name__} is prepared already (its forward is "
                         f"{model.forward!r}); set model.forward.recipe to change the recipe")
    if convert:
        te.convert_model(model, module_filter)
    elif not any(hasattr(m, "fp8_meta") for m in model.modules()):
        raise ValueError(f"prepare_model(convert=False): {type(model).__name__} holds no fp8kit layer, so FP8 "
                         "autocast would change nothing")
    model.forward = FP8Forward(model, recipe, use_during_eval)
    return model
