"""Study 5's shared settings (preregistration/study5/PLAN.md): models, grid, folders, the examples a design plans.
Below every other study-5 module, so none of them imports another in a circle."""

from __future__ import annotations

from pathlib import Path

import yaml

PREREG = Path("preregistration/study5")
RESULTS = Path("results/study5")
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
STUDY4_DESIGN = Path("preregistration/study4/design.yaml")  # the task x level grid per model, carried over
LENGTHS = (1024, 2048)
BUDGETS = (0.5, 0.25)  # 0.5 primary; 0.25 the smaller budget whose draws are held against one draw at 0.5
PILOT_SEED = 11500
PILOT_N_PER_CELL = 6
SEED = 11000
MAX_DRAWS = 4  # the pilot decodes 4 independent draws; R in {2, 3, 4} is read off their first R
MAX_NEW_TOKENS = 24


def task_grid(tag: str, root: Path = Path(".")) -> dict[str, int]:
    """{task: level} of a model: study 4's locked grid (its pilot-chosen levels), unchanged."""
    design = yaml.safe_load((root / STUDY4_DESIGN).read_text())
    return dict(design["models"][tag]["tasks"])


def examples_for(tasks: dict[str, int], lengths, n_per_cell: int, seed: int, tokenizer) -> list:
    from kvcert.tasks import make_examples

    out = []
    for task, level in tasks.items():
        for length in lengths:
            out += make_examples(task, n_per_cell, length, tokenizer, seed=seed, level=level)
    return out


def load_rows(path: str | Path):
    """answers.jsonl as a DataFrame (a last line cut short by a kill is skipped)."""
    from kvcert.studies.study4.collect import load_answers

    return load_answers(path)
