"""The autocast stack of each thread (fp8kit.pytorch.autocast pushes and pops its frames): here, below every module
that asks what the innermost autocast says, so that they need not import autocast itself."""

from __future__ import annotations

import threading
from typing import Any, Optional, Tuple

__all__ = ["STACK", "current_frame", "fp8_enabled"]


class _ThreadStack(threading.local):
    """The autocast stack of this thread (a tuple of Frames). A thread-local rather than a ContextVar, because
    torch.compile traces thread-local attributes but not ContextVar.reset."""

    def __init__(self):
        # set per thread (threading.local runs __init__ in each), never a class default: torch.compile guards on
        # the instance's __dict__, which must look the same before and after a compiled call
        self.frames: Tuple[Any, ...] = ()


STACK = _ThreadStack()


def current_frame() -> Optional[Any]:
    """The innermost autocast frame (fp8kit.pytorch.autocast.Frame), or None outside any autocast."""
    stack = STACK.frames
    return stack[-1] if stack else None


def fp8_enabled() -> bool:
    """True inside an autocast with enabled=True (Transformer Engine's `FP8GlobalStateManager.is_fp8_enabled()`)."""
    frame = current_frame()
    return frame is not None and frame.enabled
