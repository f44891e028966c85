"""A table keyed by class, for the registration points that dispatch on a type (recipe families, GEMM rules):
`table[cls]` is the entry of the class itself or of its nearest registered base class. The table is a dict of the
classes looked up so far, so a lookup on the hot path is one dictionary access done in C; only a class seen for the
first time runs `__missing__`, which walks its MRO (and keeps the answer, except while torch.compile traces: a graph
must not write to a module-level table, which would be a side effect it has to replay)."""

from __future__ import annotations

from typing import Dict, Tuple, TypeVar

import torch

V = TypeVar("V")

__all__ = ["ClassTable"]


class ClassTable(dict):
    """`register(cls, value)`; `table[cls]` (or `lookup(cls)`) -> the value of `cls` or of its nearest registered base
    class, a TypeError naming `what` and the registered classes if none; `classes()` in registration order."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self._own: Dict[type, object] = {}

    def register(self, cls: type, value) -> None:
        self._own[cls] = value
        self.clear()  # resolved lookups may change

    def __missing__(self, cls: type):
        for base in getattr(cls, "__mro__", (cls,)):
            if base in self._own:
                value = self._own[base]
                if not torch.compiler.is_compiling():
                    self[cls] = value
                return value
        raise TypeError(f"fp8kit: no {self.what} is registered for {getattr(cls, '__name__', cls)} (known: "
                        f"{', '.join(c.__name__ for c in self._own)})")

    def lookup(self, cls: type):
        return self[cls]

    def classes(self) -> Tuple[type, ...]:
        return tuple(self._own)
