"""Study 4's shared settings and record helpers (preregistration/study4/PLAN.md): the models, the design's grid, the
folders, the examples a model's design plans and whether its records are complete. Below every other study-4 module
(kvcert.studies.study4.cli and .regeneration both read it), so none of them imports another in a circle."""

from __future__ import annotations

from pathlib import Path

import yaml

PREREG = Path("preregistration/study4")
RESULTS = Path("results/study4")
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
STUDY3_TASKS = ("multikey_needle", "multivalue_needle", "fact_qa")
NEW_TEMPLATES = {"needle_reworded": (7, 12), "word_needle": (0, 1, 2), "multikey_words": (0, 1, 3)}
LENGTHS = (1024, 2048)
SEED = 8000
N_PER_MODEL = 720
REGENERATED = "regenerated"  # results/study4/<model>/regenerated/: make reproduce's full regeneration
BUDGETS = (0.5, 0.25, 0.125)


def examples_for(design: dict, tag: str, tokenizer) -> list:
    from kvcert.tasks import make_examples

    spec = design["models"][tag]
    out = []
    for task, level in spec["tasks"].items():
        for length in design["lengths"]:
            out += make_examples(task, spec["n_per_cell"], length, tokenizer, seed=design["seed"], level=level)
    return out


def planned_examples(design: dict, tag: str) -> int:
    spec = design["models"][tag]
    return len(spec["tasks"]) * len(design["lengths"]) * int(spec["n_per_cell"])


def complete(tag: str, root: Path = Path(".")) -> bool:
    """Whether a model's records hold every planned example (claims are decided only then)."""
    from kvcert.studies.study4.collect import load_answers

    path, design_path = root / RESULTS / tag / "answers.jsonl", root / PREREG / "design.yaml"
    if not path.is_file() or not design_path.is_file():
        return False
    design = yaml.safe_load(design_path.read_text())
    return load_answers(path)["example_id"].nunique() >= planned_examples(design, tag)
