"""What a `CustomRecipe` quantizer factory receives and may return (Transformer Engine's
`transformer_engine.pytorch.quantization`): `QuantizerRole`, `QuantizerRequest`, `DelayedScalingRequest`.

The classes only, with Transformer Engine's fields, defaults and text; autocast does not run a CustomRecipe yet
(NotImplementedError naming it)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

from ..recipe import DelayedScaling, Format

__all__ = ["QuantizerRole", "QuantizerRequest", "DelayedScalingRequest"]


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """Which tensor slot asks for a quantizer: `module_type` ("linear", "grouped_linear", "dpa", ...),
    `tensor_type` ("input", "weight", "grad_output", ...) and `name` (the module instance's name); "" when not
    set."""

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("module_type", "tensor_type", "name"):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise ValueError(f"{field}: expected a str, got {type(value).__name__} {value!r}")

    def __str__(self) -> str:  # Transformer Engine's text: the fields that are set, joined by "|"
        parts = [f"{f}={getattr(self, f)}" for f in ("module_type", "tensor_type", "name") if getattr(self, f)]
        return "|".join(parts) if parts else "QuantizerRole()"


@dataclasses.dataclass(frozen=True)
class QuantizerRequest:
    """Base of the requests a quantizer factory returns instead of a quantizer when the quantizer needs state that
    the library allocates and shares."""


@dataclasses.dataclass(frozen=True)
class DelayedScalingRequest(QuantizerRequest):
    """A request for a delayed-scaling quantizer with library-managed state (history and scale shared with the
    step's batched update). Fields and defaults as DelayedScaling's (validated the same way, a bad value raising
    ValueError naming the field); every request of one recipe state must carry equal values."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        DelayedScaling(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})  # the same checks
