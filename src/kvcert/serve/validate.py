"""One check of a generation request for `kvcert.generate` and `kvcert generate`: every refusal is one ValueError
whose message names the problem and the fix, the same words from the API and the command line (which prints it as
its one `error:` line, exit code 2).

The command line runs it before the model loads (without a tokenizer); `generate` runs it again with the tokenizer,
which adds the round-trip check: the context, the question and the answer prefix must each decode back to the text
given, or the boundary between context and question would shift silently.
"""

from __future__ import annotations

import math
import unicodedata
from numbers import Real

MAX_SHOWN = 5  # characters named in a round-trip refusal


def _decode(tokenizer, text: str) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _name(ch: str) -> str:
    return f"U+{ord(ch):04X} ({unicodedata.name(ch, unicodedata.category(ch))})"


def round_trip_problem(tokenizer, text: str, what: str) -> str | None:
    """Why `text` does not decode back to itself through the tokenizer (the characters it drops or changes, where the
    first sits, and the fix), or None when it does."""
    if _decode(tokenizer, text) == text:
        return None
    # which characters: each distinct one on its own (a few hundred tokenizer calls at most)
    bad = [ch for ch in dict.fromkeys(text) if _decode(tokenizer, ch) != ch]
    if bad:
        first = min(text.index(ch) for ch in bad)
        shown = ", ".join(_name(ch) for ch in bad[:MAX_SHOWN]) + (", ..." if len(bad) > MAX_SHOWN else "")
        return (
            f"the {what} does not round-trip through the tokenizer: it drops or changes {len(bad)} kind(s) of "
            f"character, {shown}, the first at character {first}; strip control characters and unassigned code "
            "points (text extracted from a binary file has them), or pass plain text"
        )
    return (
        f"the {what} does not round-trip through the tokenizer (the characters pass one by one, their combination "
        "does not); normalize the text (e.g. unicodedata.normalize('NFC', text)) or pass plain text"
    )


def validate_request(
    *,
    context: object = None,
    question: object = None,
    budget: object = None,
    max_new_tokens: object = None,
    answer_prefix: object = None,
    tokenizer=None,
    messages: object = None,
) -> None:
    """Raise ValueError (`<problem>; <fix>`) for a request `generate` cannot serve; None arguments are not checked
    (context and question are not checked when messages= is given; it has its own check)."""
    if messages is None:
        for what, value, fix in (
            ("context", context, "pass the document the question is about"),
            ("question", question, "pass the question to answer from the context"),
        ):
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"the {what} is {type(value).__name__}, not text; {fix} as a str (decode bytes first)")
            if not value.strip():
                raise ValueError(f"the {what} is empty; {fix}")
    if answer_prefix is not None and not isinstance(answer_prefix, str):
        raise ValueError(f"the answer prefix is {type(answer_prefix).__name__}, not text; pass a str, or None for auto")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, Real):
            raise ValueError(f"the budget {budget!r} is not a number; pass the share of the prompt to keep, e.g. 0.25")
        if not 0.0 < budget <= 1.0:
            shown = f"{budget:g}" if math.isfinite(budget) else str(budget)
            raise ValueError(f"the budget {shown} is outside (0, 1]; pass the share of the prompt to keep, e.g. 0.25")
    if max_new_tokens is not None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens {max_new_tokens!r} is not a whole number; pass a token count, e.g. 64")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens} is below 1; pass a positive token count, e.g. 64")
    if tokenizer is not None and messages is None:
        for what, value in (("context", context), ("question", question), ("answer prefix", answer_prefix)):
            if isinstance(value, str) and value:
                why = round_trip_problem(tokenizer, value, what)
                if why is not None:
                    raise ValueError(why)


def warn_empty_answer(stopped: str, answer_prefix: str | None) -> None:
    """One line when the answer is empty, naming the fix (the usual cause: the model ends its turn at once)."""
    import warnings

    if answer_prefix:
        fix = f"pass answer_prefix= with more of the answer's first words than {answer_prefix!r}, e.g. 'The code is'"
    else:
        fix = "pass answer_prefix='Answer:' or the answer's first words, e.g. answer_prefix='The code is'"
    warnings.warn(
        f"kvcert: the answer is empty (stopped at {stopped} before any text); {fix} (CLI: --answer-prefix)",
        stacklevel=3,
    )
