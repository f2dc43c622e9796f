"""Defaults shared by the decoder (kvcert.hf) and the Hydra schema (kvcert.config), defined once."""

DEFAULT_MAX_NEW_TOKENS = 24  # one token per digit: two 7-digit values as a list take ~19 tokens
