"""A table keyed by class, for the registration points that dispatch on a type (recipe families, GEMM rules): a
lookup finds the entry of the class itself or of its nearest registered base class, and remembers the answer, so a
lookup costs one dictionary access after the first."""

from __future__ import annotations

from typing import Dict, Generic, Tuple, TypeVar

V = TypeVar("V")

__all__ = ["ClassTable"]


class ClassTable(Generic[V]):
    """`register(cls, value)`; `lookup(cls)` -> the value of `cls` or of its nearest registered base class (TypeError
    naming `what` and the registered classes if none); `classes()` in registration order."""

    def __init__(self, what: str):
        self.what = what
        self._own: Dict[type, V] = {}
        self._resolved: Dict[type, V] = {}

    def register(self, cls: type, value: V) -> None:
        self._own[cls] = value
        self._resolved.clear()

    def lookup(self, cls: type) -> V:
        value = self._resolved.get(cls)
        if value is None:
            for base in cls.__mro__:
                if base in self._own:
                    value = self._resolved[cls] = self._own[base]
                    break
            else:
                raise TypeError(f"fp8kit: no {self.what} is registered for {cls.__name__} (known: "
                                f"{', '.join(c.__name__ for c in self._own)})")
        return value

    def classes(self) -> Tuple[type, ...]:
        return tuple(self._own)
