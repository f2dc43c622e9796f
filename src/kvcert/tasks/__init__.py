"""Workloads: RULER-style synthetic tasks over packaged essays, real QA datasets, your own JSON lines, prompt
rendering and scoring."""

from kvcert.tasks.datasets_hf import load_dataset_examples
from kvcert.tasks.haystack import SOURCES, TaskError
from kvcert.tasks.jsonl import load_jsonl_examples
from kvcert.tasks.render import Rendered, render
from kvcert.tasks.ruler import (
    DIFFICULTY,
    MAX_NEW_TOKENS,
    TASKS,
    Example,
    check_difficulty,
    default_depth,
    make_examples,
)
from kvcert.tasks.scoring import score

__all__ = [
    "DIFFICULTY",
    "MAX_NEW_TOKENS",
    "SOURCES",
    "TASKS",
    "Example",
    "Rendered",
    "TaskError",
    "check_difficulty",
    "default_depth",
    "load_dataset_examples",
    "load_jsonl_examples",
    "make_examples",
    "render",
    "score",
]
