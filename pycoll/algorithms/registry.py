"""Algorithms by collective and name; ``auto`` asks the cost model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: collective -> algorithm name -> function
ALGORITHMS: dict[str, dict[str, Callable[..., None]]] = {}


def register(collective: str, name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register ``fn`` as algorithm ``name`` of ``collective``."""

    def deco(fn: Callable[..., None]) -> Callable[..., None]:
        ALGORITHMS.setdefault(collective, {})[name] = fn
        return fn

    return deco


def names(collective: str) -> tuple[str, ...]:
    return tuple(ALGORITHMS.get(collective, {}))


def get(collective: str, name: str) -> Callable[..., Any]:
    return ALGORITHMS[collective][name]
