"""Study 5's command line (preregistration/study5/PLAN.md):

python -m kvcert.studies.study5 pilot --model smollm2|gemma3     the pilot's records (resumable)
python -m kvcert.studies.study5 select                            the pilot rule -> preregistration/study5/design.yaml
python -m kvcert.studies.study5 run --model smollm2|gemma3        the confirmatory records (after the lock; resumable)
python -m kvcert.studies.study5 analyze [--partial]               claims, tables and report
python -m kvcert.studies.study5 run --model M --regenerate         make reproduce: every record again, in
                                                                   results/study5/<model>/regenerated/ (resumable)
python -m kvcert.studies.study5 regenerate-check [-n 5 | --regenerated]   against the published records
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from kvcert.studies.study5.common import (
    BUDGETS,
    LENGTHS,
    MAX_DRAWS,
    MODELS,
    PILOT_N_PER_CELL,
    PILOT_SEED,
    PREREG,
    RESULTS,
    SEED,
    examples_for,
    task_grid,
)


def _model(tag: str):
    import torch

    from kvcert.hf import load_model

    if tag not in MODELS:
        raise SystemExit(f"study5: unknown model {tag!r}; choose one of {', '.join(MODELS)}")
    torch.set_num_threads(1)
    return load_model(MODELS[tag])


def pilot(tag: str, root: Path = Path(".")) -> Path:
    """The pilot's records of one model (section 3), resumable."""
    from kvcert.studies.study5.collect import collect

    model, tokenizer = _model(tag)
    examples = examples_for(task_grid(tag, root), LENGTHS, PILOT_N_PER_CELL, PILOT_SEED, tokenizer)
    print(f"study5 pilot {tag}: {len(examples)} examples, budgets {BUDGETS}, {MAX_DRAWS} draws + split halves")
    out = root / RESULTS / "pilot" / tag
    return collect(model, tokenizer, examples, BUDGETS, out, model_name=MODELS[tag], r_max=MAX_DRAWS)


def select(root: Path = Path(".")) -> dict:
    """Section 3's rule on both models' pilot records -> design.yaml."""
    from kvcert.studies.study5.common import load_rows
    from kvcert.studies.study5.pilot import choose

    frames = {tag: load_rows(root / RESULTS / "pilot" / tag / "answers.jsonl") for tag in MODELS}
    choice = choose(frames)
    design = dict(
        seed=SEED,
        lengths=list(LENGTHS),
        budgets=list(BUDGETS),
        variant=choice["variant"],
        draws=choice["draws"],
        form=choice["form"],
        pilot=choice["report"],
        models={
            tag: dict(
                model=MODELS[tag],
                tasks=task_grid(tag, root),
                n_per_cell=choice["n_per_cell"][tag],
            )
            for tag in MODELS
        },
    )
    (root / PREREG / "design.yaml").write_text(yaml.safe_dump(design, sort_keys=False))
    return design


def run(tag: str, root: Path = Path("."), regenerate: bool = False) -> Path:
    """The confirmatory records of one model (after the lock), resumable; regenerate=True writes a full regeneration
    to results/study5/<model>/regenerated/ instead (make reproduce), leaving the published records alone."""
    from kvcert.studies.study5.collect import collect
    from kvcert.studies.study5.regeneration import REGENERATED

    if not (root / PREREG / "LOCK.json").is_file():
        raise SystemExit(
            "study5: preregistration/study5/LOCK.json is missing: lock the study first (make lock STUDY=study5)"
        )
    design = yaml.safe_load((root / PREREG / "design.yaml").read_text())
    model, tokenizer = _model(tag)
    spec = design["models"][tag]
    examples = examples_for(spec["tasks"], design["lengths"], int(spec["n_per_cell"]), int(design["seed"]), tokenizer)
    r_max = int(design["draws"]) if design["variant"] == "independent" else 2
    print(f"study5 {tag}: {len(examples)} examples, budgets {design['budgets']}, {r_max} draws + split halves")
    return collect(
        model,
        tokenizer,
        examples,
        design["budgets"],
        root / RESULTS / tag / (REGENERATED if regenerate else ""),
        model_name=MODELS[tag],
        r_max=r_max,
    )


def complete(tag: str, root: Path = Path(".")) -> bool:
    """Whether a model's records hold every example its design plans (claims are decided only then)."""
    from kvcert.studies.study5.common import load_rows

    path, design_path = root / RESULTS / tag / "answers.jsonl", root / PREREG / "design.yaml"
    if not path.is_file() or not design_path.is_file():
        return False
    design = yaml.safe_load(design_path.read_text())
    spec = design["models"][tag]
    planned = len(spec["tasks"]) * len(design["lengths"]) * int(spec["n_per_cell"])
    return load_rows(path)["example_id"].nunique() >= planned


def scorecard_cards(root: Path = Path(".")) -> dict[str, dict]:
    """Study 5's columns for the combined scorecard ({"study5_<model>": {"lock", "claims"}}; rows S5.P1-S5.P5, not to
    be read as study 4's P1-P5), from results/study5/claims.json for models whose records are complete; {} before."""
    import json

    from kvcert.prereg import verify

    path = root / RESULTS / "claims.json"
    if not path.is_file():
        return {}
    result = json.loads(path.read_text())
    cards = {}
    for tag in MODELS:
        if tag not in result or not complete(tag, root):
            continue
        predictions = yaml.safe_load((root / PREREG / f"predictions_{tag}.yaml").read_text())["claims"]
        claims = [
            dict(id=f"S5.{cid}", claim=predictions[cid]["claim"], verdict=c["verdict"], observed=c["estimate"],
                 ci=[c["lo"], c["hi"]], unit=predictions[cid].get("unit", ""), n_examples=c.get("n"),
                 prediction=predictions[cid].get("prediction"), details={"ci_kind": "95% paired bootstrap"})
            for cid, c in result[tag]["claims"].items()
        ]  # fmt: skip
        cards[f"study5_{tag}"] = {"lock": verify(root, study="study5"), "claims": claims}
    return cards


def regenerate_check(n: int, regenerated: bool, tags: list[str], root: Path = Path(".")) -> int:
    """Each model's regeneration report (results/study5/<model>/regeneration.md for the full one,
    regeneration_check.md for -n); exit code 1 if any fails."""
    from kvcert.studies.study5.regeneration import full_regeneration_check, regeneration_check

    failed = []
    for tag in tags:
        passed, text = full_regeneration_check(tag, root) if regenerated else regeneration_check(tag, n, root)
        name = "regeneration.md" if regenerated else "regeneration_check.md"
        (root / RESULTS / tag / name).write_text(text)
        print(text)
        failed += [] if passed else [tag]
    if failed:
        print(f"study5 regeneration check FAILED for {', '.join(failed)}: a finding (DEVIATIONS first)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcert.studies.study5", description="Study 5: draws that disagree")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("pilot", "run"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, choices=sorted(MODELS))
        if name == "run":
            s.add_argument("--regenerate", action="store_true", help="a full regeneration into <model>/regenerated/")
    g = sub.add_parser("regenerate-check", help="rerun the first N published examples per model and compare")
    g.add_argument("-n", type=int, default=5)
    g.add_argument("--regenerated", action="store_true", help="compare the full regeneration (make reproduce)")
    g.add_argument("--model", choices=sorted(MODELS), help="one model (default: both)")
    sub.add_parser("select")
    a = sub.add_parser("analyze")
    a.add_argument("--partial", action="store_true", help="an interim report on incomplete records (no claims)")
    args = p.parse_args(argv)
    if args.command == "pilot":
        print(f"wrote {pilot(args.model)}")
    elif args.command == "select":
        design = select()
        print(yaml.safe_dump({k: design[k] for k in ("variant", "draws", "form")}), end="")
    elif args.command == "run":
        print(f"wrote {run(args.model, regenerate=args.regenerate)}")
    elif args.command == "regenerate-check":
        return regenerate_check(args.n, args.regenerated, [args.model] if args.model else list(MODELS))
    else:
        from kvcert.studies.study5.analysis import analyze

        analyze(partial=args.partial)
    return 0
