"""Designs: how a budget of kept tokens is drawn from importance scores. One file per design."""

from __future__ import annotations

from collections.abc import Callable

from kvcert.core.designs import randomized, randomized_no_offset, topk, uniform
from kvcert.core.selection import Selection

DESIGNS: dict[str, Callable[..., Selection]] = {
    "topk": topk.select,
    "randomized": randomized.select,
    "randomized_no_offset": randomized_no_offset.select,
    "uniform": uniform.select,
}


def get_design(name: str) -> Callable[..., Selection]:
    if name not in DESIGNS:
        raise ValueError(f"design must be one of {sorted(DESIGNS)}, got {name!r}")
    return DESIGNS[name]
