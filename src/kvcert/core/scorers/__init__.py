"""Scorers: importance s_i per (layer, KV head, token). One file per scorer."""

from kvcert.core.scorers.key_norm import key_norm_scores
from kvcert.core.scorers.random import random_scores
from kvcert.core.scorers.streaming import streaming_scores
from kvcert.core.scorers.window import window_scores

__all__ = ["key_norm_scores", "random_scores", "streaming_scores", "window_scores"]
