"""kvcert: error certificates for KV-cache eviction via randomized design."""

__version__ = "0.1.0"
