"""Certified generation for a user's prompt: `generate` (one prompt, a compressed cache, a calibrated certificate per
token, optional escalation), `Calibration` (`kvcert calibrate`), the per-token certificate, and the HTML view."""

from kvcert.serve.calibration import Calibration, CalibrationError
from kvcert.serve.generate import Escalated, Escalation, Generation, Token, default_policy, generate


def load_model(name_or_path: str, **kwargs):
    """`kvcert.hf.load_model`, with the model tagged by its name so `generate` finds its shipped calibration."""
    from kvcert.hf import load_model as hf_load_model

    model, tokenizer = hf_load_model(name_or_path, **kwargs)
    model.kvcert_name = name_or_path
    return model, tokenizer


__all__ = [
    "Calibration",
    "CalibrationError",
    "Escalated",
    "Escalation",
    "Generation",
    "Token",
    "default_policy",
    "generate",
    "load_model",
]
