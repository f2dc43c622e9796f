"""Study 3's pilot (preregistration/study3/PILOT.md): a difficulty level per model and task, and the per-layer
conformal multipliers fitted on the pilot's records.

    python -m kvcert.studies.pilot3 run [--model smollm2|gemma3_270m]   # the cells (resumable), one model per call
    python -m kvcert.studies.pilot3 select                              # the rule -> preregistration/study3/

`select` writes results/study3/pilot/{summary.csv,selection.md}, preregistration/study3/difficulty.yaml (the
chosen level per model and task, or "dropped") and preregistration/study3/conformal_by_layer_<model>.csv; the
last four are hashed by study 3's lock.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import yaml

from kvcert.analysis import tables
from kvcert.run import ROOT

MODELS = ("smollm2", "gemma3_270m")  # conf/model options
LEVEL_FILES = ("study3_pilot_l0", "study3_pilot_l1", "study3_pilot_l2")  # conf/task options, level index 0..2
ELIGIBLE = (0.3, 0.8)  # PILOT.md rule 2
TARGET = 0.55  # rule 3
C1_ROWS = {"scorer": "window_question", "design": "randomized", "budget": [0.25, 0.5]}
OUT = ROOT / "results" / "study3" / "pilot"
PREREG = ROOT / "preregistration" / "study3"


def markdown_table(df: pd.DataFrame, digits: int = 4) -> str:
    """df as a Markdown table (kvcert.analysis.tables.markdown_table): numbers to `digits` significant digits, NaN /
    None as blank."""

    def cell(x: object) -> str:
        if x is None or (isinstance(x, float) and x != x):
            return ""
        return f"{x:.{digits}g}" if isinstance(x, float) else str(x)

    rows = [[cell(x) for x in r] for r in df.itertuples(index=False)]
    return tables.markdown_table(pd.DataFrame(rows, columns=[str(c) for c in df.columns]), parse_numbers=False)


def cell_config(model: str, level_index: int):
    from kvcert.reproduce import compose_claim

    return compose_claim("study3/pilot", [f"model={model}", f"task={LEVEL_FILES[level_index]}"])


def run(models: Sequence[str] = MODELS) -> list[Path]:
    """The pilot cells of the given models (each resumable), in level order; progress in results/study3/pilot/."""
    from kvcert.run import run_cell

    return [run_cell(cell_config(m, i), log=OUT / "pilot.log") for m in models for i in range(len(LEVEL_FILES))]


def run_dirs() -> dict[tuple[str, int], Path]:
    from kvcert.config import result_name

    dirs = {}
    for m in MODELS:
        for i in range(len(LEVEL_FILES)):
            cfg = cell_config(m, i)
            dirs[(str(cfg.model.name), i)] = Path(cfg.results_dir) / result_name(cfg)
    return dirs


def summarize(examples: dict[tuple[str, int], pd.DataFrame], levels: dict[int, dict[str, int]]) -> pd.DataFrame:
    """One row per (model, task, level index): the level, full-cache accuracy per length and pooled (lengths weigh
    equally), n, and the accuracy of the randomized design at 0.25 and 0.5 (for information)."""
    rows = []
    for (model, i), ex in sorted(examples.items()):
        full = ex[ex["variant"] == "full"]
        for task, g in full.groupby("task"):
            length = g["example_id"].str.extract(r"-(\d+k)-s")[0]
            by_length = g.groupby(length)["correct"].mean()
            row = {
                "model": model,
                "task": task,
                "level_index": i,
                "level": int(levels[i][task]),
                "full_accuracy": float(by_length.mean()),
                "n": int(len(g)),
            }
            row |= {f"full_{k}": float(v) for k, v in by_length.items()}
            for budget in (0.25, 0.5):
                pol = ex[(ex["task"] == task) & (ex["design"] == "randomized") & (ex["budget"] == budget)]
                row[f"randomized_{budget:g}"] = float(pol["correct"].mean()) if len(pol) else float("nan")
            rows.append(row)
    return pd.DataFrame(rows)


def select(summary: pd.DataFrame, defaults: dict[str, int]) -> pd.DataFrame:
    """PILOT.md's rule: per (model, task), the eligible level (accuracy in [0.3, 0.8]) closest to 0.55; ties to the
    level closest to the default, then the lower level; no eligible level -> dropped (level None)."""
    out = []
    for (model, task), g in summary.groupby(["model", "task"], sort=True):
        ok = g[(g["full_accuracy"] >= ELIGIBLE[0]) & (g["full_accuracy"] <= ELIGIBLE[1])]
        if ok.empty:
            out.append(
                {"model": model, "task": task, "level": None, "full_accuracy": None, "reason": "no level in range"}
            )
            continue
        key = ok.assign(
            distance=(ok["full_accuracy"] - TARGET).abs().round(12),
            from_default=(ok["level"] - defaults[task]).abs(),
        ).sort_values(["distance", "from_default", "level"])
        best = key.iloc[0]
        out.append(
            {
                "model": model,
                "task": task,
                "level": int(best["level"]),
                "full_accuracy": float(best["full_accuracy"]),
                "reason": f"closest to {TARGET} of {len(ok)} eligible",
            }
        )
    return pd.DataFrame(out)


def _levels() -> dict[int, dict[str, int]]:
    from kvcert.run import config_dir

    return {
        i: dict(yaml.safe_load((config_dir() / "task" / f"{name}.yaml").read_text())["difficulty"])
        for i, name in enumerate(LEVEL_FILES)
    }


def select_and_write() -> pd.DataFrame:
    """Apply the rule to the pilot's records and write the summary, the selection and the multipliers."""
    from kvcert.analysis import accuracy
    from kvcert.studies.cells import fit_layer_multipliers, read_run
    from kvcert.tasks.ruler import DIFFICULTY

    dirs = run_dirs()
    missing = [str(d) for d in dirs.values() if not (d / "examples.parquet").exists()]
    if missing:
        raise FileNotFoundError(f"pilot cells not complete: {', '.join(missing)}; run `... pilot3 run` first")
    examples = {key: pd.read_parquet(d / "examples.parquet") for key, d in dirs.items()}
    summary = summarize(examples, _levels())
    chosen = select(summary, {t: v[1] for t, v in DIFFICULTY.items()})
    OUT.mkdir(parents=True, exist_ok=True)
    summary.to_csv(OUT / "summary.csv", index=False)
    document: dict = {"rule": "preregistration/study3/PILOT.md", "seed": 3000, "models": {}}
    for model, g in chosen.groupby("model"):
        document["models"][model] = {
            r.task: (int(r.level) if r.level is not None and pd.notna(r.level) else "dropped") for r in g.itertuples()
        }
    PREREG.mkdir(parents=True, exist_ok=True)
    (PREREG / "difficulty.yaml").write_text(
        "# Study 3's difficulty level per model and task, chosen by preregistration/study3/PILOT.md's rule from the\n"
        "# pilot (seed 3000; results/study3/pilot/summary.csv) by `python -m kvcert.studies.pilot3 select`.\n"
        + yaml.safe_dump(document, sort_keys=False)
    )
    fits = {}
    for model in sorted({m for m, _ in dirs}):
        frames = [read_run(d, None) for (m, _), d in sorted(dirs.items()) if m == model]
        ex = pd.concat([f[0] for f in frames], ignore_index=True)
        st = pd.concat([f[1] for f in frames], ignore_index=True)
        variants = sorted(accuracy.select_rows(ex, C1_ROWS)["variant"].astype(str).unique())
        fits[model] = fit_layer_multipliers(ex, st[st["variant"].isin(variants)], C1_ROWS)
        fits[model].to_csv(PREREG / f"conformal_by_layer_{model}.csv", index=False)
    lines = [
        "# Study 3 pilot: selection (PILOT.md's rule)",
        "",
        "Full-cache accuracy per level (15 examples each):",
        "",
    ]
    lines += [markdown_table(summary, 3), "", "Chosen:", "", markdown_table(chosen, 3), ""]
    for model, fit in fits.items():
        lines += [f"Per-layer multipliers, {model} (pilot C1 cells):", "", markdown_table(fit, 4), ""]
    (OUT / "selection.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.studies.pilot3", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["run", "select"])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(MODELS if args.model == "all" else [args.model])
    else:
        select_and_write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
