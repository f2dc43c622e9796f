"""The five offline RULER-style tasks, generated deterministically from a seed.

Each example depends only on (task, context_tokens, seed, index, source, depth): example i of a set of 50 is the
same as example i of a set of 10, so smoke runs are prefixes of full runs. Randomness comes from a
``random.Random`` seeded with a string (hashed with SHA-512 by Python, so independent of PYTHONHASHSEED); the
global random state is never touched.

Answers are kept short so that the model can give them within ``MAX_NEW_TOKENS`` (24) new tokens: the SmolLM2
tokenizer spends one token per digit, so a 7-digit value costs 7 tokens, and for multi-value / variable tracking
the model writes a list ("- 8865514\n- 2636696", about 19 tokens). Single-answer tasks stop at the first period or
newline (see ``render.stop_strings_for``), so they use about 8-10 tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvcert.tasks.haystack import Needle, TaskError, build_context

TASKS: tuple[str, ...] = ("single_needle", "multikey_needle", "multivalue_needle", "variable_tracking", "fact_qa")
MAX_NEW_TOKENS = 24
LIST_TASKS = frozenset({"multivalue_needle", "variable_tracking"})  # answers are lists
# One difficulty knob per task (config `task.difficulty: {task: level}`): the parameter it sets, its default level
# (the level of every example before the knob existed) and the levels allowed. Study 3 picks a level per model and
# task by a pilot (preregistration/study3/PILOT.md).
DIFFICULTY: dict[str, tuple[str, int, range]] = {
    "single_needle": ("digits", 7, range(1, 21)),  # digits of the value to copy
    "multikey_needle": ("distractors", 3, range(0, 41)),  # needles with other keys
    "multivalue_needle": ("values", 2, range(1, 7)),  # values of the one key, all asked for
    "variable_tracking": ("hops", 1, range(0, 9)),  # assignments between the value and the answer variables
    "fact_qa": ("distractors", 3, range(0, 41)),  # facts of the same kinds about other names
}
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class Example:
    id: str  # stable, e.g. "single_needle-1k-s0-0007"
    task: str
    context: str
    question: str
    answers: tuple[str, ...]  # gold strings
    depth: float  # measured relative character position of the (first) needle, 0..1 (NaN for real datasets)
    metric: str  # "ruler_all", "ruler_any", "f1", "em"
    target_tokens: int  # requested context length in model tokens (0 for real datasets)
    answer_prefix: str = ""  # start of the assistant turn (RULER's answer prefix); the model continues it
    stop_strings: tuple[str, ...] | None = None  # task=jsonl's own stops (None: render.stop_strings_for's defaults)


# word lists, as one string each for compactness
_ADJECTIVES = (  # noqa: SIM905
    "amber ancient bitter brave bright calm clever cold crimson curious dusty eager faint fierce gentle golden grumpy "
    "hollow humble icy jolly lazy lively lonely loud mellow misty noble odd pale proud quiet rapid rusty shy silent "
    "silver sleepy smooth solemn spicy steady sturdy swift tender tiny vivid wandering warm wild witty"
).split()
_NOUNS = (  # noqa: SIM905
    "anchor badger basket beacon beetle bison canyon castle cedar comet cricket dolphin ember falcon fern fig fjord "
    "garnet glacier harbor heron island jackal kettle lantern lemur magnet maple meadow otter owl parsnip pebble "
    "pigeon quarry quill raven river saddle spruce tapir thistle tiger tulip valley walrus willow yak zebra"
).split()
_SYLLABLES = "bar bel cor dan fel gor hal ker lun mar nor pel quin ros sal tor vel wen zan dri kal mon tis ver".split()  # noqa: SIM905
_ENDINGS = {"country": ["ia", "ania", "istan", "or"], "place": ["mont", "ford", "heim", "ton", "vale", "burg"]}
_FACTS = (
    # (fact sentence, question, answer prefix); {a} is an invented name, {b} the answer (another invented name)
    (
        "The capital of the invented country {a} is {b}.",
        "What is the capital of the invented country {a}?",
        "The capital of {a} is",
    ),
    (
        "The invented element {a} was discovered by a chemist named {b}.",
        "Who discovered the invented element {a}?",
        "The invented element {a} was discovered by",
    ),
    (
        "The fictional river {a} flows into a lake called {b}.",
        "Which lake does the fictional river {a} flow into?",
        "The river {a} flows into",
    ),
    (
        "The invented game {a} was first played in the town of {b}.",
        "In which town was the invented game {a} first played?",
        "The game {a} was first played in",
    ),
)


def default_depth(index: int) -> float:
    """Depth of example ``index`` when none is given: a golden-ratio sequence over 0.1..0.9, evenly spread for
    any prefix of the examples and independent of how many are requested."""
    return 0.1 + 0.8 * ((index * _GOLDEN) % 1.0)


def _key(rng: random.Random, used: set[str]) -> str:
    while True:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in used:
            used.add(key)
            return key


def _number(rng: random.Random, digits: int, used: set[str]) -> str:
    while True:
        value = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if value not in used:
            used.add(value)
            return value


def _name(rng: random.Random, kind: str, used: set[str]) -> str:
    while True:
        stem = "".join(rng.choice(_SYLLABLES) for _ in range(2))
        name = (stem + rng.choice(_ENDINGS[kind])).capitalize()
        if name not in used:
            used.add(name)
            return name


def _varname(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(3))
        if name not in used:
            used.add(name)
            return name


def _other_depths(rng: random.Random, k: int, avoid: float) -> list[float]:
    """k depths in 0.05..0.95, each at least 0.05 away from the target needle's depth."""
    depths: list[float] = []
    while len(depths) < k:
        d = rng.uniform(0.05, 0.95)
        if abs(d - avoid) >= 0.05:
            depths.append(d)
    return depths


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _single_needle(rng: random.Random, depth: float, digits: int = 7):
    used: set[str] = set()
    key, value = _key(rng, used), _number(rng, digits, set())
    question = f"What is the special magic number for {key} mentioned in the text above?"
    prefix = f"The special magic number for {key} mentioned in the text is"
    return [Needle(_magic(key, value), depth)], question, (value,), "ruler_all", prefix


def _multikey_needle(rng: random.Random, depth: float, distractors: int = 3):
    keys: set[str] = set()
    values: set[str] = set()
    key, value = _key(rng, keys), _number(rng, 7, values)
    needles = [Needle(_magic(key, value), depth)]
    for d in _other_depths(rng, distractors, depth):
        needles.append(Needle(_magic(_key(rng, keys), _number(rng, 7, values)), d))
    question = f"What is the special magic number for {key} mentioned in the text above?"
    prefix = f"The special magic number for {key} mentioned in the text is"
    return needles, question, (value,), "ruler_all", prefix


def _multivalue_needle(rng: random.Random, depth: float, values: int = 2):
    seen: set[str] = set()
    key = _key(rng, set())
    gold = tuple(_number(rng, 7, seen) for _ in range(values))
    needles = [Needle(_magic(key, gold[0]), depth)]
    needles += [Needle(_magic(key, v), d) for v, d in zip(gold[1:], _other_depths(rng, values - 1, depth))]
    question = f"What are all the special magic numbers for {key} mentioned in the text above?"
    prefix = f"The special magic numbers for {key} mentioned in the text are:"
    return needles, question, gold, "ruler_all", prefix


def _variable_tracking(rng: random.Random, depth: float, hops: int = 1):
    names: set[str] = set()
    values: set[str] = set()
    value, other = _number(rng, 5, values), _number(rng, 5, values)
    chain = [_varname(rng, names) for _ in range(hops + 1)]
    decoy = [_varname(rng, names) for _ in range(hops + 1)]
    # the chain reads forwards: later links sit after the first one
    later = sorted(rng.uniform(depth + 0.02, 0.97) for _ in range(hops)) if depth < 0.95 else [0.97] * hops
    needles = [Needle(f"VAR {chain[0]} = {value}.", depth)]
    needles += [Needle(f"VAR {b} = VAR {a}.", d) for a, b, d in zip(chain, chain[1:], later)]
    decoy_depths = sorted(_other_depths(rng, hops + 1, depth))
    needles += [Needle(f"VAR {decoy[0]} = {other}.", decoy_depths[0])]
    needles += [Needle(f"VAR {b} = VAR {a}.", d) for a, b, d in zip(decoy, decoy[1:], decoy_depths[1:])]
    question = (
        f"Which variables are assigned the value {value}, directly or through other variables, in the text above?"
    )
    prefix = f"The variables assigned the value {value} are:"
    return needles, question, tuple(chain), "ruler_all", prefix


def _fact_qa(rng: random.Random, depth: float, distractors: int = 3):
    used: set[str] = set()
    order = rng.sample(range(len(_FACTS)), len(_FACTS))
    facts = []
    for j in range(distractors + 1):
        template, question, prefix = _FACTS[order[j % len(order)]]
        a = _name(rng, "country", used)
        b = _name(rng, "place", used)
        facts.append((template.format(a=a, b=b), question.format(a=a), b, prefix.format(a=a)))
    depths = [depth, *_other_depths(rng, distractors, depth)]
    needles = [Needle(fact[0], d) for fact, d in zip(facts, depths)]
    return needles, facts[0][1], (facts[0][2],), "ruler_any", facts[0][3]


_GENERATORS = {
    "single_needle": _single_needle,
    "multikey_needle": _multikey_needle,
    "multivalue_needle": _multivalue_needle,
    "variable_tracking": _variable_tracking,
    "fact_qa": _fact_qa,
}


def check_difficulty(difficulty: dict[str, int] | None) -> dict[str, int]:
    """The levels as {task: int}, every task known and every level allowed; raises TaskError with one line."""
    levels: dict[str, int] = {}
    for task, level in (difficulty or {}).items():
        if task not in DIFFICULTY:
            raise TaskError(f"task.difficulty names '{task}', which has no difficulty knob; use {', '.join(TASKS)}")
        name, default, allowed = DIFFICULTY[task]
        if isinstance(level, bool) or not isinstance(level, int) or level not in allowed:
            raise TaskError(
                f"task.difficulty.{task}={level!r}: {task}'s knob is its {name} (default {default}), an integer in "
                f"{allowed.start}..{allowed.stop - 1}"
            )
        levels[task] = level
    return levels


def _length_tag(tokens: int) -> str:
    return f"{tokens // 1000}k" if tokens % 1000 == 0 else str(tokens)


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
    """n examples of an offline task with contexts of about ``context_tokens`` tokens of ``tokenizer``.

    ``depth`` fixes the relative depth of the (first) needle for all examples; by default it follows
    ``default_depth(i)``. ``level`` sets the task's difficulty knob (``DIFFICULTY``); None or the default level
    gives the examples that existed before the knob (same random stream, same ids). Another level enters the
    random seed and the id (``multikey_needle-d9-1k-s0-0000``). Same arguments -> identical examples."""
    if task not in _GENERATORS:
        raise TaskError(f"unknown task '{task}': use one of {', '.join(TASKS)}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise TaskError(f"needle depth must be in [0, 1], got {depth}")
    if n < 0 or context_tokens <= 0:
        raise TaskError(f"need n >= 0 and context_tokens > 0, got n={n}, context_tokens={context_tokens}")
    knob, default, _ = DIFFICULTY[task]
    level = check_difficulty({task: level})[task] if level is not None else default
    knob_seed = "" if level == default else f"|{knob}={level}"
    knob_tag = "" if level == default else f"-d{level}"
    examples = []
    for i in range(n):
        d = default_depth(i) if depth is None else depth
        rng = random.Random(f"kvcert|{task}|{context_tokens}|{seed}|{i}|{source}|{d!r}{knob_seed}")
        needles, question, answers, metric, prefix = _GENERATORS[task](rng, d, **{knob: level})
        context = build_context(needles, context_tokens, tokenizer, rng, source)
        first = needles[0].text
        tag = "" if source == "paul_graham" else f"-{source}"
        examples.append(
            Example(
                id=f"{task}{knob_tag}-{_length_tag(context_tokens)}{tag}-s{seed}-{i:04d}",
                task=task,
                context=context,
                question=question,
                answers=answers,
                depth=context.index(first) / len(context),
                metric=metric,
                target_tokens=context_tokens,
                answer_prefix=prefix,
            )
        )
    return examples
