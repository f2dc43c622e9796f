"""Prompt rendering: the model's chat template (or plain text) around (context + question), with an exact boundary.

The user message is ``context + "\\n\\n" + question``. The templated text is split right after the context; the
two halves are tokenized separately (no added special tokens, as ``apply_chat_template`` does) and concatenated,
so ``input_ids[:question_start]`` is exactly the template opening plus the context and ``input_ids[question_start:]``
is exactly the question, the template's closing tokens, the assistant generation prompt and the example's
answer prefix (RULER's: the assistant turn starts with e.g. "The special magic number for X mentioned in the text
is", so that a small model answers within a few tokens instead of restating the question). Both halves must
decode back to their text, otherwise rendering fails rather than silently shifting the boundary.

No system prompt is added beyond what the template itself forces (SmolLM2's template inserts its default one).

Base models (no chat template, or ``prompt_format="plain"``) get RULER's base-model rendering: the BOS token if the
tokenizer adds one, the context, a blank line, the question, a space and the answer prefix, with no template
tokens; ``input_ids[:question_start]`` is BOS + context exactly as in the chat case. A base model does not end its
turn, so plain prompts also stop at the first newline, list tasks included (RULER's base-model convention; the list
answer prefix ends with a colon and the model continues on the same line).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcert.tasks.haystack import TaskError
from kvcert.tasks.ruler import LIST_TASKS, Example

SEPARATOR = "\n\n"  # between the context and the question inside the user message
ANSWER_SEPARATOR = " "  # plain rendering: between the question and the answer prefix (RULER's base template)
PROMPT_FORMATS = ("auto", "chat", "plain")
# the answer prefix a prompt gets on a base model when none is given (kvcert.generate's answer_prefix=None): asked a
# bare question in the plain format, a base model such as Gemma 3 270M often writes a newline (a stop) and nothing else
BASE_ANSWER_PREFIX = "Answer:"
ROUND_TRIP = (
    "the prompt does not round-trip through the tokenizer (it drops or changes some characters); strip control "
    "characters and unassigned code points (text extracted from a binary file has them), or pass plain text"
)


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


def end_of_turn_strings(tokenizer) -> tuple[str, ...]:
    """The end-of-turn / end-of-text tokens of the tokenizer's vocabulary (EOS first)."""
    stops = [tok for tok in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<end_of_turn>") if tok]
    vocab = tokenizer.get_vocab()
    return tuple(s for i, s in enumerate(stops) if s in vocab and s not in stops[:i])


def stop_strings_for(tokenizer, task: str = "", prompt_format: str = "chat") -> tuple[str, ...]:
    """End-of-turn strings of the template; for single answers also the first period or newline (the answer is
    complete by then and the model otherwise keeps talking). In chat format list answers start with a blank line, so
    list tasks stop only at the end of the turn (or at the token limit); in plain format every task also stops at
    the first newline."""
    stops = end_of_turn_strings(tokenizer)
    if task in LIST_TASKS:
        return (*stops, "\n") if prompt_format == "plain" else tuple(stops)
    return (*stops, "\n", ".")


def resolve_prompt_format(tokenizer, prompt_format: str | None = "auto") -> str:
    """``chat`` or ``plain``: ``auto`` (or None) means chat when the tokenizer has a chat template, else plain."""
    fmt = prompt_format or "auto"
    if fmt not in PROMPT_FORMATS:
        raise TaskError(f"prompt_format={fmt!r}: use one of {', '.join(PROMPT_FORMATS)}")
    if fmt == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise TaskError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
    return fmt


def default_answer_prefix(tokenizer, prompt_format: str | None = "auto") -> str:
    """The answer prefix for a prompt without one: BASE_ANSWER_PREFIX in the plain (base-model) format, where
    ``render`` puts it after the question and a space as it does a task's own prefix; none in the chat format (the
    assistant turn starts the answer)."""
    return BASE_ANSWER_PREFIX if resolve_prompt_format(tokenizer, prompt_format) == "plain" else ""


def _stops(example: Example, tokenizer, prompt_format: str) -> tuple[str, ...]:
    """The example's own stop strings after the end-of-turn tokens (task=jsonl), else the task's defaults."""
    if example.stop_strings is not None:
        return tuple(dict.fromkeys((*end_of_turn_strings(tokenizer), *example.stop_strings)))
    return stop_strings_for(tokenizer, example.task, prompt_format)


def _bos_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (BOS for Llama/Gemma), none for e.g. GPT-2 style."""
    with_special = list(tokenizer("x", add_special_tokens=True)["input_ids"])
    plain = _ids(tokenizer, "x")
    n = len(with_special) - len(plain)
    if n > 0 and with_special[n:] == plain:
        return with_special[:n]
    return []


def _render_plain(example: Example, tokenizer) -> Rendered:
    context, suffix = example.context, SEPARATOR + example.question
    if example.answer_prefix:
        suffix += ANSWER_SEPARATOR + example.answer_prefix
    context_ids, suffix_ids = _ids(tokenizer, context), _ids(tokenizer, suffix)
    if _decode(tokenizer, context_ids) != context or _decode(tokenizer, suffix_ids) != suffix:
        raise TaskError(f"example {example.id}: {ROUND_TRIP}")
    prefix_ids = _bos_ids(tokenizer) + context_ids
    return Rendered(
        example=example,
        input_ids=prefix_ids + suffix_ids,
        question_start=len(prefix_ids),
        stop_strings=_stops(example, tokenizer, "plain"),
    )


def render(example: Example, tokenizer, prompt_format: str | None = "auto") -> Rendered:
    """Token ids of the full prompt and the index where the question part starts.

    ``prompt_format``: ``chat`` (the tokenizer's chat template), ``plain`` (base models, see the module docstring)
    or ``auto`` (chat when the tokenizer has a chat template, else plain)."""
    if resolve_prompt_format(tokenizer, prompt_format) == "plain":
        return _render_plain(example, tokenizer)
    messages = [{"role": "user", "content": example.context + SEPARATOR + example.question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    cut = text.find(example.context)
    if cut < 0 or text.find(example.context, cut + 1) >= 0:
        raise TaskError(
            f"example {example.id}: the chat template changed or repeated the context (an empty context, or one whose "
            "text the template also writes or alters); pass a non-empty context that is more than a template word, "
            "or prompt_format='plain'"
        )
    cut += len(example.context)
    prefix, suffix = text[:cut], text[cut:] + example.answer_prefix
    prefix_ids, suffix_ids = _ids(tokenizer, prefix), _ids(tokenizer, suffix)
    if _decode(tokenizer, prefix_ids) != prefix or _decode(tokenizer, suffix_ids) != suffix:
        raise TaskError(f"example {example.id}: {ROUND_TRIP}")
    return Rendered(
        example=example,
        input_ids=prefix_ids + suffix_ids,
        question_start=len(prefix_ids),
        stop_strings=_stops(example, tokenizer, "chat"),
    )
