"""Certified generation for a user's prompt: `generate` (one prompt, a compressed cache, a calibrated certificate per
token, optional escalation, optional draws and their agreement), `RateEscalator` (a share of a stream's answers),
`Calibration` (`kvcert calibrate`), the per-token certificate, and the HTML view."""

from typing import TYPE_CHECKING

from kvcert.serve.calibration import Calibration, CalibrationError
from kvcert.serve.escalator import RateEscalator
from kvcert.serve.generate import (
    DEFAULT_ESCALATION,
    STUDY4_ESCALATION,
    Escalated,
    Escalation,
    Generation,
    Token,
    default_policy,
    generate,
)

if TYPE_CHECKING:
    from kvcert.hf.loading import ALIASES, load_model


# load_model and ALIASES are kvcert.hf.loading's own objects (one function, one behaviour: `kvcert.load_model is
# kvcert.serve.load_model is kvcert.hf.load_model`), imported when first used (PEP 562) so that importing
# kvcert.serve does not import transformers.
_FROM_LOADING = ("ALIASES", "load_model")


def __getattr__(name: str):
    if name in _FROM_LOADING:
        from kvcert.hf import loading

        value = getattr(loading, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'kvcert.serve' has no attribute {name!r}")


__all__ = [
    "ALIASES",
    "Calibration",
    "CalibrationError",
    "DEFAULT_ESCALATION",
    "Escalated",
    "Escalation",
    "Generation",
    "RateEscalator",
    "STUDY4_ESCALATION",
    "Token",
    "default_policy",
    "generate",
    "load_model",
]
