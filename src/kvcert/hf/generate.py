"""The convenience wrapper: one example, one shared prefill, every policy decoded together (see prefill.py)."""

from __future__ import annotations

from collections.abc import Callable

from kvcert.hf.decode import DecodeOptions, VariantResult
from kvcert.hf.prefill import Prefill
from kvcert.policy import Policy


def generate_variants(
    model,
    tokenizer,
    prompt,
    policies: list[Policy],
    options: DecodeOptions = DecodeOptions(),
    *,
    example_id: str | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[VariantResult]:
    """Decode every policy from one shared prefill; results in the order of `policies`.

    prompt: anything with `input_ids` and `question_start` (kvcert.tasks.Rendered, kvcert.hf.Prompt); the design
    draws are seeded from `example_id` (default: the prompt's example id). on_step(step) runs after each decode
    step's forward (the benchmark times steps with it)."""
    prefill = Prefill.record(model, prompt, context_window=options.context_window, example_id=example_id)
    batch = prefill.compress(policies, options)
    return batch.decode(options, tokenizer, on_step=on_step)
