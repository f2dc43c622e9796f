"""The thin glue between kvcert and transformers: loading, the attention function, one example's flow.

verification (oracle on): prefill = Prefill.record(model, prompt) -> batch = prefill.compress(policies, options)
serving (oracle off):      batch = compress_while_reading(model, prompt, policies, options)
results = batch.decode(options, tokenizer)   (generate_variants picks the mode from options.oracle)
"""

from kvcert.hf.compressed_batch import CompressedBatch
from kvcert.hf.decode import DEFAULT_MAX_NEW_TOKENS, DecodeOptions, VariantResult
from kvcert.hf.generate import generate_variants
from kvcert.hf.loading import load_model
from kvcert.hf.model_support import ModelLoadError
from kvcert.hf.prefill import Prefill, Prompt
from kvcert.hf.serving_prefill import compress_while_reading, probe_prompt
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
    "compress_while_reading",
    "probe_prompt",
    "generate_variants",
    "load_model",
    "tiny_random_model",
]
