"""Study 5's regeneration contract (preregistration/study5/DEVIATIONS.md, stop 44): regenerated records against the
published ones.

A regenerated row is matched to its published row by example and budget. The answers must be identical (draw 0's,
the full cache's and every draw's own) in at least IDENTICAL_SHARE of the rows; on those rows each signal must move
less than its tolerance (TOLERANCE: study 4's locked values where the signal has one; a disagreement is a difference
of two log-probabilities, so twice a log-probability's); and on a full regeneration every claim decided again must
keep its published verdict.

    python -m kvcert.studies.study5 regenerate-check -n 5          # the first 5 published examples per model, rerun
    python -m kvcert.studies.study5 run --model smollm2 --regenerate   # make reproduce: every record again ...
    python -m kvcert.studies.study5 regenerate-check --regenerated     # ... compared, verdicts decided again
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from kvcert.studies.study5.common import MODELS, PREREG, RESULTS, examples_for, load_rows

IDENTICAL_SHARE = 0.95
REGENERATED = "regenerated"  # results/study5/<model>/regenerated/
ANSWERS = ("answer", "full_answer", "draw_answers")


def tolerance_table(columns) -> dict[str, tuple[str, float]]:
    """{signal column: (kind, tolerance)} for the columns a record has."""
    table = {"certificate": ("rel", 1e-3), "confidence": ("abs", 1e-3)}
    table.update({c: ("abs", 2e-3) for c in columns if str(c).startswith("disagreement_")})
    return table


def compare(records: pd.DataFrame, new: pd.DataFrame) -> tuple[bool, list[dict]]:
    """Published vs regenerated rows: (passed, the report's rows)."""
    both = records.merge(new, on=["example_id", "budget"], suffixes=("_published", "_regenerated"))
    same = pd.Series(True, index=both.index)
    for name in ANSWERS:
        same &= both[f"{name}_published"].astype(str) == both[f"{name}_regenerated"].astype(str)
    ok = bool(len(both)) and bool(same.mean() >= IDENTICAL_SHARE)
    rows = [dict(item="identical answers (draw 0, full cache, every draw)", value=f"{int(same.sum())} / {len(both)}",
                 tolerance=f">= {IDENTICAL_SHARE:.0%}", result="pass" if ok else "FAIL")]  # fmt: skip
    passed = ok
    for name, (kind, tol) in tolerance_table(records.columns).items():
        if f"{name}_regenerated" not in both:
            continue
        x, y = both.loc[same, f"{name}_published"].astype(float), both.loc[same, f"{name}_regenerated"].astype(float)
        diff = (x - y).abs() / (x.abs().clip(lower=1e-12) if kind == "rel" else 1.0)
        worst = float(diff.max()) if diff.notna().any() else 0.0
        good = worst <= tol
        passed &= good
        rows.append(dict(item=f"{name} ({kind} difference, identical answers)", value=f"{worst:.2e}",
                         tolerance=f"<= {tol:g}", result="pass" if good else "FAIL"))  # fmt: skip
    return passed, rows


def verdict_rows(records: pd.DataFrame, new: pd.DataFrame, tag: str, root: Path = Path(".")) -> list[dict]:
    """Every claim decided on the published and on the regenerated records (the same locked analysis)."""
    from kvcert.studies.study5.analysis import evaluate_claim

    design = yaml.safe_load((root / PREREG / "design.yaml").read_text())
    preds = yaml.safe_load((root / PREREG / f"predictions_{tag}.yaml").read_text())["claims"]
    rows = []
    for cid, spec in preds.items():
        a, b = evaluate_claim(records, design, spec)["verdict"], evaluate_claim(new, design, spec)["verdict"]
        rows.append(dict(item=f"{cid} verdict", value=f"{a} / {b}", tolerance="identical",
                         result="pass" if a == b else "FAIL"))  # fmt: skip
    return rows


def report(tag: str, what: str, passed: bool, rows: list[dict]) -> str:
    from kvcert.analysis.tables import markdown_table

    return "\n\n".join([
        f"# Study 5 regeneration check: {MODELS[tag]}",
        f"{what}: **{'PASS' if passed else 'FAIL'}** (tolerances: kvcert.studies.study5.regeneration, declared in "
        "preregistration/study5/DEVIATIONS.md before any regeneration was compared)",
        markdown_table(pd.DataFrame(rows)),
    ]) + "\n"  # fmt: skip


def regeneration_check(tag: str, n: int, root: Path = Path(".")) -> tuple[bool, str]:
    """Rerun the first n published examples (by id) of one model at its pinned single thread and compare."""
    import torch

    from kvcert.hf import load_model
    from kvcert.studies.study5.collect import example_rows

    records = load_rows(root / RESULTS / tag / "answers.jsonl")
    design = yaml.safe_load((root / PREREG / "design.yaml").read_text())
    spec = design["models"][tag]
    torch.set_num_threads(1)
    model, tokenizer = load_model(MODELS[tag])
    examples = examples_for(spec["tasks"], design["lengths"], int(spec["n_per_cell"]), int(design["seed"]), tokenizer)
    by_id = {e.id: e for e in examples}
    ids = sorted(set(records["example_id"]) & set(by_id))[:n]
    r_max = int(design["draws"]) if design["variant"] == "independent" else 2
    new = pd.DataFrame([r for i in ids for r in example_rows(model, tokenizer, by_id[i], design["budgets"],
                                                              model_name=MODELS[tag], r_max=r_max)])  # fmt: skip
    passed, rows = compare(records, new)
    return passed, report(tag, f"{len(ids)} examples (the first by id)", passed, rows)


def full_regeneration_check(tag: str, root: Path = Path(".")) -> tuple[bool, str]:
    """make reproduce's comparison: the full regeneration (`run --regenerate`) against the published records, and
    every claim decided again."""
    path = root / RESULTS / tag / REGENERATED / "answers.jsonl"
    if not path.is_file():
        raise SystemExit(f"study5 {tag}: no regeneration at {path}; run `study5 run --model {tag} --regenerate`")
    records, new = load_rows(root / RESULTS / tag / "answers.jsonl"), load_rows(path)
    missing = set(records["example_id"]) - set(new["example_id"])
    if missing:
        raise SystemExit(f"study5 {tag}: the regeneration lacks {len(missing)} examples; rerun it (it resumes)")
    passed, rows = compare(records, new)
    verdicts = verdict_rows(records, new, tag, root)
    passed &= all(r["result"] == "pass" for r in verdicts)
    n = int(new["example_id"].nunique())
    return passed, report(tag, f"all {n} examples regenerated", passed, rows + verdicts)
