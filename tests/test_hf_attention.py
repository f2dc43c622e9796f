"""The attention switch is a context manager that restores the model's previous implementation."""

import pytest

from kvcert.hf import tiny_random_model
from kvcert.hf.attention import NAME, kvcert_attention_on


def test_attention_switch_restores_the_previous_implementation():
    model, _ = tiny_random_model("llama", attn_implementation="eager")
    with kvcert_attention_on(model):
        assert model.config._attn_implementation == NAME
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError), kvcert_attention_on(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"
