"""The convenience wrapper: one example, one shared prefill, every policy decoded together (see prefill.py)."""

from __future__ import annotations

from collections.abc import Callable

from kvcert.hf.decode import DecodeOptions, VariantResult
from kvcert.hf.prefill import Prefill
from kvcert.hf.scorer_inputs import reads_inputs
from kvcert.hf.serving_prefill import compress_while_reading
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
    follow: dict[int, int] | None = None,
) -> list[VariantResult]:
    """Decode every policy from one shared prefill; results in the order of `policies`.

    prompt: anything with `input_ids` and `question_start` (kvcert.tasks.Rendered, kvcert.hf.Prompt); the design
    draws are seeded from `example_id` (default: the prompt's example id). on_step(step) runs after each decode
    step's forward (the benchmark times steps with it). follow: policy index -> the policy index whose tokens that
    row is fed instead of its own greedy ones (teacher forcing; kvcert.hf.draws).

    With the oracle on (verification mode) the full prompt is recorded once and kept for the oracle; with it off
    (serving mode) each layer is compressed inside the prefill forward and the full cache is never held."""
    if options.oracle:
        prefill = Prefill.record(
            model,
            prompt,
            context_window=options.context_window,
            example_id=example_id,
            capture_queries=reads_inputs(policies),
        )
        batch = prefill.compress(policies, options)
    else:
        batch = compress_while_reading(model, prompt, policies, options, example_id=example_id)
    return batch.decode(options, tokenizer, on_step=on_step, follow=follow)
