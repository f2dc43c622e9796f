"""Designs: how a budget of kept tokens is drawn from importance scores. One file per design, one registry here.

Every design has the same signature, `select(scores, n_keep, *, tail_fraction, floor, score_power, generator,
draws)`, and returns a `Selection`; `draws` are a random design's Uniform(0, 1) numbers drawn beforehand
(`core.probabilities.uniform_draws(scores.shape, generator)`), which a compression one layer at a time slices, and
`order` the scores' `core.selection.descending_order`, when the caller already has it (never needed: it saves a sort).
The registry also says what a design promises: whether its retained set carries known
inclusion probabilities (a certificate) and whether it applies the -log(pi) offset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvcert.core.designs import randomized, randomized_no_offset, topk, uniform
from kvcert.core.selection import Selection


@dataclass(frozen=True)
class DesignSpec:
    name: str
    select: Callable[..., Selection]
    has_certificate: bool  # a Poisson tail at known pi: the error is estimable (False: undefined, never zero)
    offset: bool  # the -log(pi) Hajek offset is applied to kept logits
    random: bool  # needs a generator


DESIGN_SPECS: dict[str, DesignSpec] = {
    "topk": DesignSpec("topk", topk.select, has_certificate=False, offset=False, random=False),
    "randomized": DesignSpec("randomized", randomized.select, has_certificate=True, offset=True, random=True),
    "randomized_no_offset": DesignSpec(
        "randomized_no_offset", randomized_no_offset.select, has_certificate=True, offset=False, random=True
    ),
    "uniform": DesignSpec("uniform", uniform.select, has_certificate=True, offset=True, random=True),
}
DESIGNS: dict[str, Callable[..., Selection]] = {name: spec.select for name, spec in DESIGN_SPECS.items()}


def design_spec(name: str) -> DesignSpec:
    if name not in DESIGN_SPECS:
        raise ValueError(f"design must be one of {sorted(DESIGN_SPECS)}, got {name!r}")
    return DESIGN_SPECS[name]


def get_design(name: str) -> Callable[..., Selection]:
    return design_spec(name).select
