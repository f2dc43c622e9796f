"""Scoring as RULER does for its synthetic tasks, and SQuAD-style F1 / exact match for real datasets.

- ``ruler_all``: score = fraction of gold strings found in the prediction (case-insensitive substring match);
  correct iff all are found.
- ``ruler_any``: score = 1 if any gold string is found, else 0; correct iff score is 1.
- ``f1``: the best SQuAD token F1 over the gold answers (lower-case, punctuation and articles removed,
  whitespace tokens); correct iff F1 >= 0.5 (a common threshold for "answered" in long-context QA; the exact
  F1 is kept as the score).
- ``em``: exact match after the same normalization; score and correct agree. ``exact`` is the same metric under
  the name ``task=jsonl`` offers.
- ``contains``: 1 if any gold string is found in the prediction (case-insensitive substring), else 0.
- a callable by dotted name, ``pkg.mod:func`` or ``pkg.mod.func`` (``task=jsonl``): ``func(prediction, answers)``
  with the gold answers as a tuple of strings returns a bool (correct), a number in [0, 1] (the score; correct iff
  >= 0.5, as F1) or a (score, correct) pair. The module must be importable (installed, or on PYTHONPATH).
"""

from __future__ import annotations

import importlib
import math
import re
import string
from collections import Counter
from collections.abc import Callable
from functools import cache

from kvcert.tasks.haystack import TaskError
from kvcert.tasks.ruler import Example

F1_CORRECT = 0.5
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


BUILTIN_METRICS = ("ruler_all", "ruler_any", "f1", "em", "exact", "contains")


@cache
def metric_function(name: str) -> Callable:
    """The callable a dotted metric name (``pkg.mod:func`` or ``pkg.mod.func``) names; a one-line TaskError if none."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise TaskError(f"metric '{name}' is not one of {', '.join(BUILTIN_METRICS)} nor a dotted name pkg.mod:func")
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except ImportError as err:
        raise TaskError(
            f"metric '{name}': cannot import {module_name} ({err}); install it or put it on PYTHONPATH"
        ) from None
    except AttributeError:
        raise TaskError(f"metric '{name}': {module_name} has no '{attr}'") from None
    if not callable(target):
        raise TaskError(f"metric '{name}' is a {type(target).__name__}, not a function (prediction, answers)")
    return target


def _custom(name: str, prediction: str, example: Example) -> tuple[float, bool]:
    value = metric_function(name)(prediction, tuple(example.answers))
    if isinstance(value, tuple) and len(value) == 2:
        value, correct = value
    elif isinstance(value, bool):
        correct = value
    else:
        correct = None
    if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1):
        number = float(value)
        return number, bool(number >= F1_CORRECT if correct is None else correct)
    raise TaskError(
        f"metric '{name}' returned {value!r} for example {example.id}; return a bool, a number in [0, 1] or"
        " (score, correct)"
    )


def score(prediction: str, example: Example) -> tuple[float, bool]:
    """(score in [0, 1], correct) of a model answer for an example, by the example's metric."""
    golds = example.answers
    if not golds:
        raise TaskError(f"example {example.id} has no gold answers")
    if example.metric in ("ruler_all", "ruler_any", "contains"):
        pred = prediction.lower()
        found = [g.lower() in pred for g in golds]
        if example.metric == "ruler_all":
            value = sum(found) / len(found)
            return value, all(found)
        return float(any(found)), any(found)
    if example.metric == "f1":
        value = max(token_f1(prediction, g) for g in golds)
        return value, value >= F1_CORRECT
    if example.metric in ("em", "exact"):
        hit = any(normalize_answer(prediction) == normalize_answer(g) for g in golds)
        return float(hit), hit
    if "." in example.metric or ":" in example.metric:
        return _custom(example.metric, prediction, example)
    raise TaskError(f"example {example.id}: unknown metric '{example.metric}'")
