"""Workloads: RULER-style synthetic tasks over packaged essays, real QA datasets, your own JSON lines, prompt
rendering and scoring."""

from kvcert.tasks.datasets_hf import load_dataset_examples
from kvcert.tasks.haystack import SOURCES, TaskError
from kvcert.tasks.jsonl import load_jsonl_examples
from kvcert.tasks.render import Rendered, render
from kvcert.tasks.ruler import MAX_NEW_TOKENS, TASKS, Example, default_depth

# TASKS: the five tasks of studies 1-3; ALL_TASKS adds study 4's templates (VARIANT_TASKS, tasks/ruler_variants.py)
from kvcert.tasks.ruler_variants import ALL_TASKS, DIFFICULTY, VARIANT_TASKS, check_difficulty, make_examples
from kvcert.tasks.scoring import score

__all__ = [
    "ALL_TASKS",
    "DIFFICULTY",
    "MAX_NEW_TOKENS",
    "SOURCES",
    "TASKS",
    "VARIANT_TASKS",
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
