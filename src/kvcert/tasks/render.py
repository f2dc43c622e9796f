"""Prompt rendering: the model's chat template around (context + question), with an exact token boundary.

The user message is ``context + "\\n\\n" + question``. The templated text is split right after the context; the
two halves are tokenized separately (no added special tokens, as ``apply_chat_template`` does) and concatenated,
so ``input_ids[:question_start]`` is exactly the template opening plus the context and ``input_ids[question_start:]``
is exactly the question, the template's closing tokens, the assistant generation prompt and the example's
answer prefix (RULER's: the assistant turn starts with e.g. "The special magic number for X mentioned in the text
is", so that a small model answers within a few tokens instead of restating the question). Both halves must
decode back to their text, otherwise rendering fails rather than silently shifting the boundary.

No system prompt is added beyond what the template itself forces (SmolLM2's template inserts its default one).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcert.tasks.haystack import TaskError
from kvcert.tasks.ruler import LIST_TASKS, Example

SEPARATOR = "\n\n"  # between the context and the question inside the user message


@dataclass(frozen=True)
class Rendered:
    example: Example
    input_ids: list[int]  # chat template(user = context + question) + generation prompt
    question_start: int  # input_ids[:question_start] = template opening + context
    stop_strings: tuple[str, ...]


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def stop_strings_for(tokenizer, task: str = "") -> tuple[str, ...]:
    """End-of-turn strings of the template; for single answers also the first period or newline (the answer is
    complete by then and the model otherwise keeps talking). List answers start with a blank line, so list tasks
    stop only at the end of the turn (or at the token limit)."""
    stops = [tok for tok in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<end_of_turn>") if tok]
    vocab = tokenizer.get_vocab()
    stops = [s for i, s in enumerate(stops) if s in vocab and s not in stops[:i]]
    return tuple(stops) if task in LIST_TASKS else (*stops, "\n", ".")


def render(example: Example, tokenizer) -> Rendered:
    """Token ids of the full prompt and the index where the question part starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise TaskError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
    messages = [{"role": "user", "content": example.context + SEPARATOR + example.question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    cut = text.find(example.context)
    if cut < 0 or text.find(example.context, cut + 1) >= 0:
        raise TaskError(f"example {example.id}: the chat template changed or repeated the context")
    cut += len(example.context)
    prefix, suffix = text[:cut], text[cut:] + example.answer_prefix
    prefix_ids, suffix_ids = _ids(tokenizer, prefix), _ids(tokenizer, suffix)
    if _decode(tokenizer, prefix_ids) != prefix or _decode(tokenizer, suffix_ids) != suffix:
        raise TaskError(f"example {example.id}: the prompt does not round-trip through the tokenizer")
    return Rendered(
        example=example,
        input_ids=prefix_ids + suffix_ids,
        question_start=len(prefix_ids),
        stop_strings=stop_strings_for(tokenizer, example.task),
    )
