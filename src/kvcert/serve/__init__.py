"""Certified generation for a user's prompt: `generate` (one prompt, a compressed cache, a calibrated certificate per
token, optional escalation), `Calibration` (`kvcert calibrate`), the per-token certificate, and the HTML view."""

from kvcert.serve.calibration import Calibration, CalibrationError
from kvcert.serve.generate import DEFAULT_ESCALATION, Escalated, Escalation, Generation, Token, default_policy, generate

# short names of the packaged models (the Hydra config group's names)
ALIASES = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m", "gemma3_270m": "gemma3-270m"}


def load_model(name_or_path: str, **kwargs):
    """`kvcert.hf.load_model` (a packaged model's name or short name, a local folder or a hub id), with the model
    tagged by its name so `generate` finds its shipped calibration."""
    from kvcert.hf import load_model as hf_load_model

    name = ALIASES.get(name_or_path, name_or_path)
    model, tokenizer = hf_load_model(name, **kwargs)
    model.kvcert_name = name
    return model, tokenizer


__all__ = [
    "ALIASES",
    "Calibration",
    "CalibrationError",
    "DEFAULT_ESCALATION",
    "Escalated",
    "Escalation",
    "Generation",
    "Token",
    "default_policy",
    "generate",
    "load_model",
]
