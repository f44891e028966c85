"""fp8kit's version of Hugging Face's `Conv1D` (GPT-2, GPT, ...): `y = x @ weight + bias` with `weight` stored
`[nx, nf]` (in, out), transposed with respect to torch.nn.Linear.

Importing this module registers the class with `convert_model`, which then swaps every
`transformers.pytorch_utils.Conv1D` for it, keeping the same Parameter
objects, names and layout, so a checkpoint of the converted model loads into the stock model class and back
(the FP8 state adds `<name>.fp8_meta.*` keys, as for fp8kit's Linear).

The class subclasses Hugging Face's Conv1D, so code that checks `isinstance(m, Conv1D)` (GPT-2's weight
initialisation, for one) treats it as one, and it is NOT a torch.nn.Linear, so code that expects a Linear's
`[out, in]` weight leaves it alone. The FP8 GEMMs are those of an `fp8kit.pytorch.Linear` that the module
owns privately (not a submodule) and hands its weight, transposed into a contiguous copy inside the autograd
graph, at every call: the same numbers as `fp8kit.pytorch.Linear(nx, nf)` holding `weight.T`, bit for bit (tested),
for one more read and write of the weight per call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from transformers.pytorch_utils import Conv1D as HFConv1D

from fp8kit.pytorch import Linear
from fp8kit.pytorch.convert import register_converter


class Conv1D(HFConv1D):
    """Hugging Face `Conv1D(nf, nx)` whose GEMMs run in FP8 inside `fp8kit.pytorch.autocast`.

    Parameters: `weight` `[nx, nf]`, `bias` `[nf]` (or None), as the stock class. Outside an enabled autocast it
    computes the stock class's product (bit for bit in the CPU tests). `fp8_meta` (delayed-scaling states) and
    `fp8_stats` (statistics) are those of fp8kit's Linear; `forward(x, is_first_microbatch=None)` as Linear's.

    Build one from a stock layer with `Conv1D.from_hf(layer)` (what `convert_model` does) or directly with
    `Conv1D(nf, nx, device=None, dtype=None)` (Hugging Face's initialisation: weight normal(0, 0.02), bias 0).
    """

    def __init__(self, nf: int, nx: int, device=None, dtype: Optional[torch.dtype] = None, bias: bool = True):
        for name, value in (("nf", nf), ("nx", nx)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Conv1D: {name} must be a positive int, got {value!r}")
        with torch.device(device if device is not None else torch.get_default_device()):
            super().__init__(nf, nx)
        if dtype is not None:
            self.to(dtype)
        if not bias:
            self.bias = None
        # Not a submodule: state_dict keys stay `<name>.weight`, `<name>.bias`, `<name>.fp8_meta.*`.
        engine = Linear(nx, nf, bias=bias, device="meta")
        del engine.weight, engine.bias  # it gets this module's parameters, transposed, for each call
        self.__dict__["fp8_engine"] = engine

    @classmethod
    def from_hf(cls, layer: HFConv1D) -> "Conv1D":
        """An fp8kit Conv1D holding `layer`'s Parameter objects (optimizers and weight ties keep working)."""
        if not isinstance(layer, HFConv1D):
            raise TypeError(f"Conv1D.from_hf: expected a transformers Conv1D, got {type(layer).__name__}")
        new = cls(layer.nf, layer.nx, device="meta", bias=layer.bias is not None)
        new.weight = layer.weight
        new.bias = layer.bias
        new.train(layer.training)
        return new

    @property
    def fp8_meta(self) -> dict:
        """The delayed-scaling states, as fp8kit.pytorch.Linear's `fp8_meta`."""
        return self.fp8_engine.fp8_meta

    @property
    def fp8_stats(self):
        """The statistics recorder (`fp8kit.pytorch.enable_stats`), or None."""
        return self.fp8_engine.fp8_stats

    @fp8_stats.setter
    def fp8_stats(self, value) -> None:
        self.fp8_engine.fp8_stats = value

    @contextlib.contextmanager
    def _bound(self) -> Iterator[Linear]:
        """The engine holding this module's parameters for one call (not longer: copies and pickles of the module
        must not carry tensors of an old autograd graph)."""
        engine = self.fp8_engine
        # Linear's [out, in] layout, contiguous so that its GEMMs see exactly what they see in a Linear; autograd
        # carries the gradient back into this module's Parameter.
        engine.weight = self.weight.t().contiguous()
        engine.bias = None if self.bias is None else self.bias.view(-1)
        engine.training = self.training
        try:
            yield engine
        finally:
            del engine.weight, engine.bias

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """`x` `[..., nx]` -> `[..., nf]`."""
        with self._bound() as engine:
            return engine(x, is_first_microbatch=is_first_microbatch)

    # The FP8 state goes into and comes out of state_dict() under this module's own prefix.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self.fp8_engine._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        fp8_keys = {k: v for k, v in state_dict.items() if k.startswith(prefix + "fp8_meta.")}
        if fp8_keys:  # checked first: a bad FP8 entry raises before this module's parameters load
            self.fp8_engine.fp8_entries(fp8_keys, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if not fp8_keys:
            return
        # The engine takes them off unexpected_keys and loads (or reports) them; while it does, it holds this
        # module's Parameters themselves (registered), as a Linear does, so it finds their device.
        engine = self.fp8_engine
        engine.weight, engine.bias = self.weight, self.bias
        before = len(missing_keys)
        try:
            engine._load_from_state_dict(fp8_keys, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                         error_msgs)
        finally:
            del engine.weight, engine.bias
        # It was shown the FP8 entries only: its report of the parameters (loaded above) is not news.
        missing_keys[before:] = [k for k in missing_keys[before:] if k not in (prefix + "weight", prefix + "bias")]

    def __repr__(self) -> str:
        return f"Conv1D(nf={self.nf}, nx={self.nx}, fp8kit)"


# convert_model's table of layer types (the core imports no integration; this module adds its layer on import).
register_converter(HFConv1D, lambda layer: (layer.nx, layer.nf), Conv1D.from_hf, "transformers Conv1D")
