"""The thin glue between kvcert and transformers."""

# loading
from kvcert.hf.loading import ModelLoadError, load_model, tiny_random_model

__all__ = ["ModelLoadError", "load_model", "tiny_random_model"]
