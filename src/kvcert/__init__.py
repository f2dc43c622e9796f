"""kvcert: error certificates for KV-cache eviction via randomized design.

from kvcert import generate, load_model
model, tokenizer = load_model("smollm2")  # the packaged SmolLM2-135M-Instruct
print(generate(model, tokenizer, context=text, question="...", budget=0.25).summary())
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names load torch and transformers; they are imported when first used (PEP 562), so that tools that
# need neither (`make analyze`, `python -m kvcert.prereg`) do not spend seconds importing them.
_PUBLIC = {
    "Calibration": "kvcert.serve",
    "CalibrationError": "kvcert.serve",
    "Draws": "kvcert.hf.draws",  # generate(draws=Draws(...)): several draws of the policy and their agreement
    "Escalation": "kvcert.serve",
    "Generation": "kvcert.serve",
    "Policy": "kvcert.policy",
    "RateEscalator": "kvcert.serve",
    "calibrate_budget": "kvcert.serve.budget_calibration",  # kvcert calibrate-budget: a budget with a guarantee
    "generate": "kvcert.serve",
    "load_model": "kvcert.hf.loading",  # the same object as kvcert.hf.load_model
}
__all__ = [
    "Calibration",
    "CalibrationError",
    "Draws",
    "Escalation",
    "Generation",
    "Policy",
    "RateEscalator",
    "calibrate_budget",
    "generate",
    "load_model",
]

if TYPE_CHECKING:
    from kvcert.hf.draws import Draws
    from kvcert.hf.loading import load_model
    from kvcert.policy import Policy
    from kvcert.serve import Calibration, CalibrationError, Escalation, Generation, RateEscalator, generate
    from kvcert.serve.budget_calibration import calibrate_budget


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'kvcert' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
