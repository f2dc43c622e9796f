"""The thin glue between kvcert and transformers: loading, policies, shared-prefill batched decoding."""

# loading
from kvcert.hf.generate import DecodeOptions, VariantResult, generate_variants
from kvcert.hf.loading import ModelLoadError, load_model, tiny_random_model
from kvcert.hf.policy import FULL, Policy

__all__ = [
    "FULL",
    "DecodeOptions",
    "ModelLoadError",
    "Policy",
    "VariantResult",
    "generate_variants",
    "load_model",
    "tiny_random_model",
]
