"""kvcert: error certificates for KV-cache eviction via randomized design.

from kvcert import generate, load_model
model, tokenizer = load_model("smollm2-135m-instruct")
print(generate(model, tokenizer, context=text, question="...", budget=0.25).summary())
"""

__version__ = "0.1.0"

from kvcert.policy import Policy  # noqa: E402
from kvcert.serve import (  # noqa: E402
    Calibration,
    CalibrationError,
    Escalation,
    Generation,
    generate,
    load_model,
)

__all__ = ["Calibration", "CalibrationError", "Escalation", "Generation", "Policy", "generate", "load_model"]
