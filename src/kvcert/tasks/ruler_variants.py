"""Study 4's task templates: needle wordings and word answers that studies 1-3 never used.

Three single-answer tasks beside the five of ``ruler.py`` (which stays unchanged, so the examples of studies 1-3
cannot move):

- ``needle_reworded``: single-needle retrieval of a number, the needle, question and answer prefix in one of
  ``NUMBER_WORDINGS`` (drawn per example). Knob: the digits of the value (default 7, as ``single_needle``).
- ``word_needle``: one needle whose value is a lowercase word, in one of ``WORD_WORDINGS``, plus distractor needles
  with other keys and other word values, each in another wording. Knob: the distractors (default 2).
- ``multikey_words``: multi-key retrieval of a word: the target and its distractors all share the example's wording
  (from ``WORD_WORDINGS``) and differ only in their keys, as ``multikey_needle``. Knob: the distractors (default 3).

A word value is, with even odds, a real noun from ``REAL_WORDS`` (none of them a key word) or an invented
pronounceable word of three syllables from ``ruler._SYLLABLES`` ("korvelmon"); every word is alphabetic and lower
case, and scored by ``ruler_all`` (case-insensitive substring) like the numbers. Keys are adjective-noun pairs as in
``ruler.py``. Word values and keys must each occur exactly once in the finished context (case-insensitive
substring count): an example where the haystack (or another needle) happens to contain one is drawn again from the
same random stream, which keeps it deterministic (so no word hides in the essays and no key inside another, as
"icy-fig" in "spicy-fig").

Determinism is ``ruler.py``'s: example i comes from ``random.Random("kvcert|task|length|seed|i|source|depth")``
(a string seed, independent of PYTHONHASHSEED), a non-default level enters the seed and the id
(``word_needle-d5-1k-s0-0000``), and example i of a set of 50 is example i of a set of 10. ``make_examples``,
``check_difficulty`` and ``DIFFICULTY`` here cover all eight tasks (the five are passed to ``ruler.py`` unchanged);
``kvcert.tasks`` exports them.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from kvcert.tasks import ruler
from kvcert.tasks.haystack import Needle, TaskError, build_context
from kvcert.tasks.ruler import Example, _key, _length_tag, _number, _other_depths, default_depth

VARIANT_TASKS: tuple[str, ...] = ("needle_reworded", "word_needle", "multikey_words")
ALL_TASKS: tuple[str, ...] = (*ruler.TASKS, *VARIANT_TASKS)
# (parameter, default level, allowed levels), as ruler.DIFFICULTY
VARIANT_DIFFICULTY: dict[str, tuple[str, int, range]] = {
    "needle_reworded": ("digits", 7, range(1, 21)),  # digits of the value to copy
    "word_needle": ("distractors", 2, range(0, 41)),  # needles with other keys, other words and other wordings
    "multikey_words": ("distractors", 3, range(0, 41)),  # needles with other keys and words, same wording
}
DIFFICULTY: dict[str, tuple[str, int, range]] = {**ruler.DIFFICULTY, **VARIANT_DIFFICULTY}
_MAX_DRAWS = 64  # draws of one example before giving up on a context where every word occurs once


class Wording(NamedTuple):
    needle: str  # the sentence inserted into the haystack; {key}, {value}
    question: str  # {key}
    prefix: str  # the answer prefix the assistant turn starts with; {key}


NUMBER_WORDINGS: tuple[Wording, ...] = (
    Wording(
        "The access code for the {key} vault is {value}.",
        "What is the access code for the {key} vault mentioned in the text above?",
        "The access code for the {key} vault is",
    ),
    Wording(
        "Remember: {key}'s locker combination = {value}.",
        "What is the locker combination of {key} given in the text above?",
        "The locker combination of {key} is",
    ),
    Wording(
        "In the ledger, entry {key} reads {value}.",
        "What does the ledger entry {key} read in the text above?",
        "The ledger entry {key} reads",
    ),
    Wording(
        "The serial number stamped on the {key} crate is {value}.",
        "What serial number is stamped on the {key} crate, according to the text above?",
        "The serial number stamped on the {key} crate is",
    ),
    Wording(
        "Agent {key} was issued badge number {value}.",
        "Which badge number was agent {key} issued in the text above?",
        "Agent {key} was issued badge number",
    ),
    Wording(
        "Note for later: the PIN of the {key} account is {value}.",
        "What is the PIN of the {key} account noted in the text above?",
        "The PIN of the {key} account is",
    ),
)
WORD_WORDINGS: tuple[Wording, ...] = (
    Wording(
        "The secret word for the {key} vault is {value}.",
        "What is the secret word for the {key} vault mentioned in the text above?",
        "The secret word for the {key} vault is",
    ),
    Wording(
        "Remember: {key}'s password = {value}.",
        "What is the password of {key} given in the text above?",
        "The password of {key} is",
    ),
    Wording(
        "In the ledger, entry {key} reads {value}.",
        "Which word does the ledger entry {key} read in the text above?",
        "The ledger entry {key} reads",
    ),
    Wording(
        "The ship registered as {key} is named {value}.",
        "What is the name of the ship registered as {key} in the text above?",
        "The ship registered as {key} is named",
    ),
    Wording(
        "The codename of operation {key} is {value}.",
        "What is the codename of operation {key} mentioned in the text above?",
        "The codename of operation {key} is",
    ),
    Wording(
        "The {key} team picked {value} as its mascot.",
        "Which mascot did the {key} team pick, according to the text above?",
        "The mascot the {key} team picked is",
    ),
)
REAL_WORDS = (  # noqa: SIM905  (concrete nouns of five or more letters, none of them in ruler's key lists)
    "accordion almond apricot armadillo avocado bagpipe banjo cactus cobalt coconut cymbal emerald flamingo gazelle "
    "giraffe hammock harpoon iguana jasmine kayak lagoon lobster mango marmalade meerkat mongoose nectarine octopus "
    "orchid papaya peacock pelican penguin pistachio quartz rhubarb saffron sapphire squid tambourine toucan trombone "
    "turquoise ukulele vanilla violin wombat zucchini"
).split()


def _word(rng: random.Random, used: set[str]) -> str:
    """A lowercase word not drawn before in this example: a real noun or an invented three-syllable word."""
    while True:
        real = rng.random() < 0.5
        word = rng.choice(REAL_WORDS) if real else "".join(rng.choice(ruler._SYLLABLES) for _ in range(3))
        if word not in used:
            used.add(word)
            return word


def _needle_reworded(rng: random.Random, depth: float, digits: int = 7):
    wording = rng.choice(NUMBER_WORDINGS)
    key, value = _key(rng, set()), _number(rng, digits, set())
    needle = Needle(wording.needle.format(key=key, value=value), depth)
    return [needle], wording.question.format(key=key), (value,), wording.prefix.format(key=key), (key,)


def _word_needle(rng: random.Random, depth: float, distractors: int = 2):
    order = rng.sample(range(len(WORD_WORDINGS)), len(WORD_WORDINGS))  # target first, then the other wordings
    keys: set[str] = set()
    words: set[str] = set()
    depths = [depth, *_other_depths(rng, distractors, depth)]
    needles, drawn = [], []
    for j, d in enumerate(depths):
        wording = WORD_WORDINGS[order[j % len(order)]]
        key, value = _key(rng, keys), _word(rng, words)
        needles.append(Needle(wording.needle.format(key=key, value=value), d))
        drawn.append((wording, key, value))
    wording, key, value = drawn[0]  # the target
    return needles, wording.question.format(key=key), (value,), wording.prefix.format(key=key), (*keys, *words)


def _multikey_words(rng: random.Random, depth: float, distractors: int = 3):
    wording = rng.choice(WORD_WORDINGS)
    keys: set[str] = set()
    words: set[str] = set()
    key, value = _key(rng, keys), _word(rng, words)
    needles = [Needle(wording.needle.format(key=key, value=value), depth)]
    for d in _other_depths(rng, distractors, depth):
        needles.append(Needle(wording.needle.format(key=_key(rng, keys), value=_word(rng, words)), d))
    return needles, wording.question.format(key=key), (value,), wording.prefix.format(key=key), (*keys, *words)


_GENERATORS = {
    "needle_reworded": _needle_reworded,
    "word_needle": _word_needle,
    "multikey_words": _multikey_words,
}


def check_difficulty(difficulty: dict[str, int] | None) -> dict[str, int]:
    """``ruler.check_difficulty`` over all eight tasks: the levels as {task: int}; raises TaskError with one line."""
    levels: dict[str, int] = {}
    for task, level in (difficulty or {}).items():
        if task not in DIFFICULTY:
            raise TaskError(f"task.difficulty names '{task}', which has no difficulty knob; use {', '.join(ALL_TASKS)}")
        name, default, allowed = DIFFICULTY[task]
        if isinstance(level, bool) or not isinstance(level, int) or level not in allowed:
            raise TaskError(
                f"task.difficulty.{task}={level!r}: {task}'s knob is its {name} (default {default}), an integer in "
                f"{allowed.start}..{allowed.stop - 1}"
            )
        levels[task] = level
    return levels


def _once(context: str, strings) -> bool:
    low = context.lower()
    return all(low.count(s.lower()) == 1 for s in strings)


def make_examples(
    task: str,
    n: int,
    context_tokens: int,
    tokenizer,
    seed: int,
    source: str = "paul_graham",
    depth: float | None = None,
    level: int | None = None,
) -> list[Example]:
    """``ruler.make_examples`` for all eight tasks: the five of ``ruler.TASKS`` go to it unchanged, the three of
    ``VARIANT_TASKS`` are made here by the same rules (seed string, ids, depths, levels)."""
    if task in ruler.TASKS:
        return ruler.make_examples(task, n, context_tokens, tokenizer, seed, source=source, depth=depth, level=level)
    if task not in _GENERATORS:
        raise TaskError(f"unknown task '{task}': use one of {', '.join(ALL_TASKS)}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise TaskError(f"needle depth must be in [0, 1], got {depth}")
    if n < 0 or context_tokens <= 0:
        raise TaskError(f"need n >= 0 and context_tokens > 0, got n={n}, context_tokens={context_tokens}")
    knob, default, _ = DIFFICULTY[task]
    level = check_difficulty({task: level})[task] if level is not None else default
    knob_seed = "" if level == default else f"|{knob}={level}"
    knob_tag = "" if level == default else f"-d{level}"
    tag = "" if source == "paul_graham" else f"-{source}"
    examples = []
    for i in range(n):
        d = default_depth(i) if depth is None else depth
        rng = random.Random(f"kvcert|{task}|{context_tokens}|{seed}|{i}|{source}|{d!r}{knob_seed}")
        for _ in range(_MAX_DRAWS):
            needles, question, answers, prefix, once = _GENERATORS[task](rng, d, **{knob: level})
            context = build_context(needles, context_tokens, tokenizer, rng, source)
            if _once(context, once):
                break
        else:
            raise TaskError(f"{task} example {i}: no draw of {_MAX_DRAWS} had every word once in its context")
        examples.append(
            Example(
                id=f"{task}{knob_tag}-{_length_tag(context_tokens)}{tag}-s{seed}-{i:04d}",
                task=task,
                context=context,
                question=question,
                answers=answers,
                depth=context.index(needles[0].text) / len(context),
                metric="ruler_all",
                target_tokens=context_tokens,
                answer_prefix=prefix,
            )
        )
    return examples
