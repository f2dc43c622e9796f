"""Scoring as RULER does for its synthetic tasks, and SQuAD-style F1 / exact match for real datasets.

- ``ruler_all``: score = fraction of gold strings found in the prediction (case-insensitive substring match);
  correct iff all are found.
- ``ruler_any``: score = 1 if any gold string is found, else 0; correct iff score is 1.
- ``f1``: the best SQuAD token F1 over the gold answers (lower-case, punctuation and articles removed,
  whitespace tokens); correct iff F1 >= 0.5 (a common threshold for "answered" in long-context QA; the exact
  F1 is kept as the score).
- ``em``: exact match after the same normalization; score and correct agree.
"""

from __future__ import annotations

import re
import string
from collections import Counter

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


def score(prediction: str, example: Example) -> tuple[float, bool]:
    """(score in [0, 1], correct) of a model answer for an example, by the example's metric."""
    golds = example.answers
    if not golds:
        raise TaskError(f"example {example.id} has no gold answers")
    if example.metric in ("ruler_all", "ruler_any"):
        pred = prediction.lower()
        found = [g.lower() in pred for g in golds]
        if example.metric == "ruler_all":
            value = sum(found) / len(found)
            return value, all(found)
        return float(any(found)), any(found)
    if example.metric == "f1":
        value = max(token_f1(prediction, g) for g in golds)
        return value, value >= F1_CORRECT
    if example.metric == "em":
        hit = any(normalize_answer(prediction) == normalize_answer(g) for g in golds)
        return float(hit), hit
    raise TaskError(f"example {example.id}: unknown metric '{example.metric}'")
