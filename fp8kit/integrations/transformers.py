"""Hugging Face `transformers` checkpoints with fp8kit's FP8 state.

`Model.from_pretrained(dir)` builds the stock model (torch.nn.Linear, Conv1D), so the `*.fp8_meta.*` tensors that a
converted model's `save_pretrained` wrote have nowhere to go: transformers reports them as UNEXPECTED and drops
them, and a resumed delayed-scaling run starts from fresh histories and scales. The working order is: build the
model from its config, convert it, then load the directory:

    model = fp8kit.integrations.transformers.from_pretrained(AutoModelForCausalLM, "out/checkpoint-100")

or, step by step (any way of building the model):

    model = te.convert_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
    fp8kit.integrations.transformers.load_pretrained(model, path)

`transformers.Trainer(resume_from_checkpoint=...)` loads with `load_state_dict` into the model it trains, which is
converted already, so it restores the FP8 state without help.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Dict, Optional

import torch

from fp8kit.integrations import hf_conv1d  # noqa: F401  (registers GPT-2's Conv1D with convert_model)
from fp8kit.pytorch import convert_model

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


def _files(path: str):
    """The weight files of a save_pretrained directory, and whether they are safetensors."""
    for single, index, safe in ((SAFE_WEIGHTS, SAFE_INDEX, True), (TORCH_WEIGHTS, TORCH_INDEX, False)):
        if os.path.isfile(os.path.join(path, single)):
            return [os.path.join(path, single)], safe
        if os.path.isfile(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(path, s) for s in shards], safe
    raise FileNotFoundError(f"no {SAFE_WEIGHTS}, {SAFE_INDEX}, {TORCH_WEIGHTS} or {TORCH_INDEX} in {path!r}")


def checkpoint_state_dict(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the `save_pretrained` directory `path` (one file or shards), on the CPU. safetensors files
    are read as such; `pytorch_model.bin` files with `torch.load(weights_only=True)` (no arbitrary pickle)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise NotADirectoryError(f"path must be a save_pretrained directory, got {path!r}")
    files, safe = _files(os.fspath(path))
    state: Dict[str, torch.Tensor] = {}
    for name in files:
        if safe:
            from safetensors.torch import load_file

            state.update(load_file(name, device="cpu"))
        else:
            state.update(torch.load(name, map_location="cpu", weights_only=True))
    return state


def _ignored(model: torch.nn.Module, attribute: str):
    patterns = getattr(model, attribute, None) or ()
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def load_pretrained(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """Load the `save_pretrained` directory `path` into `model` (converted with `convert_model` beforehand, as the
    saved model was), FP8 state included; return `model`.

    Strict where it matters: a tensor of the checkpoint that `model` has no place for raises ValueError (e.g. FP8
    state for a layer that is not converted here), and so does a parameter or buffer of `model` that the checkpoint
    lacks, unless it is tied to one that was loaded (transformers saves tied weights once) or the model class
    declares it ignorable (`_keys_to_ignore_on_load_missing`). Layers without FP8 state in the checkpoint (a bf16
    checkpoint, current scaling) keep theirs.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_pretrained: model must be a torch.nn.Module, got {type(model).__name__}")
    state = checkpoint_state_dict(path)
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        fp8 = [k for k in result.unexpected_keys if ".fp8_meta." in k]
        hint = (" (FP8 state for layers that are not fp8kit layers here: convert the model as the saved one was, "
                "before loading)" if fp8 else "")
        raise ValueError(f"load_pretrained: {len(result.unexpected_keys)} tensors of {path} have no place in "
                         f"{type(model).__name__}{hint}: {', '.join(result.unexpected_keys[:8])}")
    loaded = {id(t) for k, t in _named_tensors(model).items() if k in state}
    ignorable = _ignored(model, "_keys_to_ignore_on_load_missing")
    tensors = _named_tensors(model)
    missing = [k for k in result.missing_keys if id(tensors.get(k)) not in loaded
               and not (ignorable is not None and ignorable.search(k))]
    if missing:
        raise ValueError(f"load_pretrained: {path} lacks {len(missing)} tensors of {type(model).__name__}: "
                         f"{', '.join(missing[:8])}")
    return model


def _named_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def from_pretrained(model_cls, path: str, module_filter: Optional[Callable[[torch.nn.Module, str], bool]] = None,
                    **kwargs) -> torch.nn.Module:
    """Build `model_cls` (an Auto class such as `AutoModelForCausalLM`, or a model class such as
    `GPT2LMHeadModel`) from the config in the `save_pretrained` directory `path`, convert it with
    `convert_model(model, module_filter)` and `load_pretrained` it. `kwargs` go to `from_config` (e.g. `dtype`,
    `attn_implementation`); the default dtype is the config's, as `from_pretrained` does. The model is returned in
    training mode; transformers' `from_pretrained` returns it in eval mode."""
    from transformers import AutoConfig

    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise NotADirectoryError(f"path must be a save_pretrained directory, got {path!r}")
    config = AutoConfig.from_pretrained(path)
    if hasattr(model_cls, "from_config"):  # the Auto classes
        model = model_cls.from_config(config, **kwargs)
    elif hasattr(model_cls, "_from_config"):  # a PreTrainedModel subclass: what from_config calls
        model = model_cls._from_config(config, **kwargs)
    else:
        raise TypeError(f"from_pretrained: model_cls must be a transformers Auto class or PreTrainedModel subclass, "
                        f"got {model_cls!r}")
    return load_pretrained(convert_model(model, module_filter), path)
