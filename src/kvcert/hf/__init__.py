"""The thin glue between kvcert and transformers: loading, the attention function, one example's flow.

prefill = Prefill.record(model, prompt)      -> batch = prefill.compress(policies, options)
results = batch.decode(options, tokenizer)   (generate_variants composes the three)
"""

from kvcert.hf.decode import DEFAULT_MAX_NEW_TOKENS, DecodeOptions, VariantResult
from kvcert.hf.generate import generate_variants
from kvcert.hf.loading import ModelLoadError, load_model
from kvcert.hf.prefill import CompressedBatch, Prefill, Prompt
from kvcert.policy import FULL, Policy
from kvcert.testing import tiny_random_model

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "FULL",
    "CompressedBatch",
    "DecodeOptions",
    "ModelLoadError",
    "Policy",
    "Prefill",
    "Prompt",
    "VariantResult",
    "generate_variants",
    "load_model",
    "tiny_random_model",
]
