"""`FP8GlobalStateManager`: Transformer Engine's class of process-wide FP8 queries, answered from fp8kit's state.

fp8kit keeps no process-global FP8 state of Transformer Engine's kind (amax buffers, global recipe): the autocast
stack is per thread (fp8kit.pytorch.frames) and scaling state belongs to modules. This class gives the queries TE
code asks of it, with TE's names and answers, so that such code runs unchanged.
"""

from __future__ import annotations

from typing import Optional, Tuple

from ..recipe import Recipe
from . import availability
from .frames import STACK, current_frame

__all__ = ["FP8GlobalStateManager"]


class FP8GlobalStateManager:
    """Transformer Engine's FP8 state queries (all class/static methods, never instantiated)."""

    def __init__(self):
        raise TypeError("FP8GlobalStateManager holds only class methods; it is not instantiated")

    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        """The key of a module's `fp8_meta` that holds the forward (or backward) scaling state."""
        return "scaling_fwd" if forward else "scaling_bwd"

    @staticmethod
    def get_fwd_bwd_key(forward: bool = True) -> str:
        """'forward' or 'backward'."""
        return "forward" if forward else "backward"

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """True inside an autocast with enabled=True on this thread."""
        frame = current_frame()
        return frame is not None and frame.enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        """True inside an autocast with calibrating=True on this thread."""
        frame = current_frame()
        return frame is not None and frame.calibrating

    @classmethod
    def get_fp8_recipe(cls) -> Optional[Recipe]:
        """The recipe of the innermost autocast on this thread, as it was at that autocast's entry (autocast keys on a
        snapshot of the recipe's fields); outside any autocast, the default recipe (as TE answers)."""
        frame = current_frame()
        return frame.recipe if frame is not None else availability.get_default_recipe()

    @classmethod
    def get_fp8_group(cls):
        """The amax reduction group of the innermost autocast (None outside any)."""
        frame = current_frame()
        return frame.group if frame is not None else None

    @classmethod
    def get_autocast_depth(cls) -> int:
        """How many autocasts are open on this thread."""
        return len(STACK.frames)

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return availability.is_fp8_available(return_reason=True)

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        return availability.is_mxfp8_available(return_reason=True)

    @classmethod
    def is_fp8_block_scaling_available(cls) -> Tuple[bool, str]:
        return availability.is_fp8_block_scaling_available(return_reason=True)

    @classmethod
    def is_nvfp4_available(cls) -> Tuple[bool, str]:
        return availability.is_nvfp4_available(return_reason=True)

    @classmethod
    def reset(cls) -> None:
        """Drop every autocast frame left open on this thread (by an autocast entered and never exited), as TE's
        reset clears its autocast state. Scaling state lives in modules and is untouched."""
        STACK.frames = ()
