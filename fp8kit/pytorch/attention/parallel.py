"""Tensor-parallel bookkeeping shared by the attention modules: the group's size, the per-rank share of the heads,
and a process-group holder that module copies share (a process group cannot be deep-copied)."""

from __future__ import annotations

from typing import Optional

__all__ = ["GroupRef", "tensor_parallel_size", "split_count", "positive_int"]


class GroupRef:
    """Holds a torch.distributed process group (or None); `copy.deepcopy` of a module keeps the same group."""

    __slots__ = ("group",)

    def __init__(self, group=None):
        self.group = group

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):  # pickling a module (torch.save) drops the process-wide handle
        return (GroupRef, (None,))


def tensor_parallel_size(where: str, tp_group, tp_size) -> int:
    """The tensor-parallel size: the group's size when a group is given, else `tp_size` (validated)."""
    if tp_group is None:
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"{where}: tp_size must be an int >= 1, got {tp_size!r}")
        return tp_size
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError(f"{where}: tp_group was given but torch.distributed is not initialised")
    return dist.get_world_size(tp_group)


def positive_int(where: str, arg: str, value, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {arg} must be a positive int, got {value!r}")
    return value


def split_count(where: str, arg: str, count: int, tp_size: int) -> int:
    """`count // tp_size`, raising ValueError naming `arg` when the tensor-parallel size does not divide it."""
    if count % tp_size:
        raise ValueError(f"{where}: {arg}={count} is not divisible by the tensor-parallel size {tp_size}")
    return count // tp_size
