"""A small generic registry with "did you mean" errors (backends, tasks, verifiers, loss variants)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from memagent.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (or to zero-argument loaders, for lazy imports).

    Args:
        kind: what the entries are, used in error messages ("backend", "task", ...).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, Callable[[], T]] = {}

    def register(self, name: str, obj: T | None = None):
        """Register ``obj`` under ``name``; usable as a decorator when ``obj`` is omitted."""
        if obj is not None:
            self._entries[name] = obj
            return obj

        def deco(o: T) -> T:
            self._entries[name] = o
            return o

        return deco

    def register_lazy(self, name: str, loader: Callable[[], T]) -> None:
        """Register a loader that is called (once) the first time ``name`` is looked up."""
        self._lazy[name] = loader

    def get(self, name: str) -> T:
        """Return the entry for ``name``.

        Raises:
            UnknownNameError: ``name`` is not registered (the message suggests the closest name).
        """
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            self._entries[name] = self._lazy.pop(name)()
            return self._entries[name]
        raise UnknownNameError(self.kind, name, self.names())

    def names(self) -> list[str]:
        return sorted({*self._entries, *self._lazy})

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
