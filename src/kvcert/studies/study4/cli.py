"""Study 4 (preregistration/study4/PLAN.md): an actionable certificate, decided by a locked study.

    python -m kvcert.studies.study4 select                 # the level pilot -> preregistration/study4/design.yaml
    python -m kvcert.studies.study4 run --model smollm2    # confirmatory records (resumable), after the lock
    python -m kvcert.studies.study4 analyze                # claims, report and scorecard cards, < 1 min
    python -m kvcert.studies.study4 token-reference --model smollm2  # today's token-level rule beside P1
    python -m kvcert.studies.study4 regenerate-check -n 5  # rerun 5 recorded examples per model and compare
    python -m kvcert.studies.study4 run --model smollm2 --regenerate   # make reproduce: every record again ...
    python -m kvcert.studies.study4 regenerate-check --regenerated     # ... compared, verdicts decided again
    python -m kvcert.studies.study4 derive -n 5            # regeneration tolerances from measured float noise
    python -m kvcert.studies.study4 thresholds             # per-budget escalation thresholds -> shipped calibrations

`run` refuses before study 4's lock exists (the lock precedes every record). Records:
results/study4/<model>/answers.jsonl; analysis: results/study4/<model>/{claims.json, report.md}.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import yaml

from kvcert.studies.study4.common import (
    BUDGETS,
    LENGTHS,
    MODELS,
    N_PER_MODEL,
    NEW_TEMPLATES,
    PREREG,
    REGENERATED,
    RESULTS,
    SEED,
    STUDY3_TASKS,
    complete,
    examples_for,
)


def _pilot_accuracy(folder: Path) -> tuple[float, int]:
    from kvcert.studies.study4.collect import load_answers

    path = folder / "answers.jsonl"
    if not path.is_file():
        return math.nan, 0
    frame = load_answers(path)
    return float(frame["full_correct"].mean()), len(frame)


def choose_level(accuracy: dict[int, float], default: int) -> int | None:
    """PLAN.md section 2, rule 2: eligible 0.3 <= a <= 0.8; closest to 0.55; ties: the default, then the lower."""
    eligible = [lvl for lvl, a in accuracy.items() if math.isfinite(a) and 0.3 <= a <= 0.8]
    if not eligible:
        return None
    return min(eligible, key=lambda lvl: (round(abs(accuracy[lvl] - 0.55), 12), lvl != default, lvl))


def select(pilot_root: Path = RESULTS / "pilot" / "levels", study3: Path = Path("preregistration/study3")) -> dict:
    """The tasks and levels per model from the level pilot, by PLAN.md section 2's rule."""
    from kvcert.tasks.ruler_variants import DIFFICULTY

    levels3 = yaml.safe_load((study3 / "difficulty.yaml").read_text())["models"]
    design: dict = dict(seed=SEED, lengths=list(LENGTHS), n_per_model=N_PER_MODEL, budgets=list(BUDGETS), models={})
    for tag, name in MODELS.items():
        tasks, pilot = {}, {}
        for task in STUDY3_TASKS:
            level = levels3[name][task]
            a, n = _pilot_accuracy(pilot_root / tag / f"{task}-d{level}")
            pilot[f"{task}-d{level}"] = dict(accuracy=a, n=n)
            if n and 0.2 <= a <= 0.95:
                tasks[task] = int(level)
        for task, candidates in NEW_TEMPLATES.items():
            acc = {}
            for level in candidates:
                a, n = _pilot_accuracy(pilot_root / tag / f"{task}-d{level}")
                pilot[f"{task}-d{level}"] = dict(accuracy=a, n=n)
                acc[level] = a if n else math.nan
            chosen = choose_level(acc, DIFFICULTY[task][1])
            if chosen is not None:
                tasks[task] = int(chosen)
        cells = len(tasks) * len(LENGTHS)
        design["models"][tag] = dict(
            model=name, tasks=tasks, n_per_cell=math.ceil(N_PER_MODEL / cells) if cells else 0, pilot=pilot
        )
    return design


def run(tag: str, threads: int = 1, root: Path = Path("."), regenerate: bool = False) -> Path:
    """The confirmatory records of one model, resumable; regenerate=True writes a full regeneration to
    results/study4/<model>/regenerated/ instead (make reproduce), leaving the published records alone."""
    import torch

    from kvcert.hf import load_model
    from kvcert.studies.study4.collect import collect

    if tag not in MODELS:
        raise SystemExit(f"study4: unknown model {tag!r}; choose one of {', '.join(MODELS)}")
    if not (root / PREREG / "LOCK.json").is_file():
        raise SystemExit(
            "study4: preregistration/study4/LOCK.json is missing: lock the study first (make lock STUDY=study4)"
        )
    design = yaml.safe_load((root / PREREG / "design.yaml").read_text())
    torch.set_num_threads(threads)
    model, tokenizer = load_model(MODELS[tag])
    examples = examples_for(design, tag, tokenizer)
    print(f"study4 {tag}: {len(examples)} examples, budgets {design['budgets']}")
    out = root / RESULTS / tag / (REGENERATED if regenerate else "")
    return collect(model, tokenizer, examples, design["budgets"], out, model_name=MODELS[tag])


def scorecard_cards(root: Path = Path(".")) -> dict[str, dict]:
    """Study 4's columns for the combined scorecard ({"study4_<model>": {"lock", "claims"}}), from the claims.json
    of models whose records are complete; {} before that."""
    from kvcert.prereg import verify

    cards = {}
    for tag in MODELS:
        path = root / RESULTS / tag / "claims.json"
        if not path.is_file() or not complete(tag, root):
            continue
        result = json.loads(path.read_text())
        predictions = yaml.safe_load((root / PREREG / f"predictions_{tag}.yaml").read_text())["claims"]
        claims = []
        for cid, c in result["claims"].items():
            spec = predictions[cid]
            claims.append(
                dict(
                    id=cid,
                    claim=spec["claim"],
                    verdict=c["verdict"],
                    observed=c["estimate"],
                    ci=[c["lo"], c["hi"]],
                    unit=spec.get("unit", ""),
                    n_examples=c.get("n"),
                    prediction=spec.get("prediction"),
                    paper_verdict=spec.get("paper_verdict"),
                    paper_value=spec.get("paper_value"),
                    details={"ci_kind": "95% paired bootstrap"},
                )
            )
        cards[f"study4_{tag}"] = {"lock": verify(root, study="study4"), "claims": claims}
    return cards


def analyze(root: Path = Path("."), partial: bool = False) -> dict:
    """Every model with complete records (or any records, with partial=True: an interim look, labelled so in the
    report and never written as claims.json): its claims (claims.json) and report (report.md); {tag: claims}."""
    from kvcert.analysis.scorecard import jsonable
    from kvcert.studies.study4.analysis import report
    from kvcert.studies.study4.claims import evaluate_claims
    from kvcert.studies.study4.collect import load_answers

    out = {}
    for tag in MODELS:
        path = root / RESULTS / tag / "answers.jsonl"
        if not path.is_file():
            continue
        if not complete(tag, root) and not partial:
            print(f"study4 {tag}: records incomplete; no claims decided (interim look: analyze --partial)")
            continue
        answers = load_answers(path)
        predictions = yaml.safe_load((root / PREREG / f"predictions_{tag}.yaml").read_text())
        claims = evaluate_claims(answers, predictions)
        n_examples = int(answers["example_id"].nunique())
        if not complete(tag, root):  # an interim look: labelled, and never the claims file the scorecard reads
            text = report(answers, f"Study 4, {MODELS[tag]}: INTERIM look at {n_examples} examples (not a result)")
            (root / RESULTS / tag / "interim_report.md").write_text(text)
            out[tag] = claims
            continue
        ref_path = root / RESULTS / tag / "token_reference.jsonl"
        reference = None
        if ref_path.is_file():  # today's token-level rule beside P1 (not a claim)
            from kvcert.studies.study4.claims import token_reference_difference

            reference = token_reference_difference(answers, load_answers(ref_path), REFERENCE_BUDGET, REFERENCE_RATE)
        result = dict(model=MODELS[tag], n_examples=n_examples, claims=claims, token_level_reference=reference)
        (root / RESULTS / tag / "claims.json").write_text(json.dumps(jsonable(result), indent=2) + "\n")
        (root / RESULTS / tag / "report.md").write_text(
            report(answers, f"Study 4, {MODELS[tag]} ({n_examples} examples)")
        )
        out[tag] = claims
    return out


REFERENCE_BUDGET, REFERENCE_RATE = 0.5, 0.2  # the token-level reference is computed beside P1 only


def token_reference(tag: str, root: Path = Path("."), threads: int = 1) -> Path:
    """Today's token-level certificate rule at P1's threshold (PLAN.md section 3): for every confirmatory example
    whose answer crosses it at budget 0.5, the answer token-level escalation gives (one extra read and decode);
    appended to results/study4/<tag>/token_reference.jsonl, resumable."""
    import numpy as np
    import torch

    from kvcert.hf import load_model
    from kvcert.studies.study4.claims import scored
    from kvcert.studies.study4.collect import _append, _done, load_answers, token_level_answer

    records = load_answers(root / RESULTS / tag / "answers.jsonl")
    cal, conf = scored(records, REFERENCE_BUDGET)
    threshold = float(np.quantile(cal["score_certificate"].dropna(), 1 - REFERENCE_RATE))
    fired = conf[conf["score_certificate"] > threshold]
    path = root / RESULTS / tag / "token_reference.jsonl"
    todo = fired[~fired["example_id"].isin(_done(path))]
    if todo.empty:
        return path
    design = yaml.safe_load((root / PREREG / "design.yaml").read_text())
    torch.set_num_threads(threads)
    model, tokenizer = load_model(MODELS[tag])
    by_id = {e.id: e for e in examples_for(design, tag, tokenizer)}
    for _, row in todo.iterrows():
        k = next(i for i, c in enumerate(row["token_certificates"]) if c > threshold)  # the firing token
        out = token_level_answer(model, tokenizer, by_id[row["example_id"]], row["tokens"][:k], model_name=MODELS[tag])
        _append(path, [dict(out, threshold=threshold, budget=REFERENCE_BUDGET, rate=REFERENCE_RATE)])
    return path


THRESHOLD_RATES = (0.05, 0.1, 0.2, 0.3)


def budget_thresholds(tag: str, root: Path = Path(".")) -> dict[str, dict[str, float]]:
    """Per budget and rate, the certificate threshold study 4's analysis uses (P1's rule: the 1 - rate quantile of
    the answer's largest certificate on the calibration split, `analysis.policy_outcomes`)."""
    from kvcert.studies.study4.analysis import policy_outcomes
    from kvcert.studies.study4.claims import scored
    from kvcert.studies.study4.collect import load_answers

    records = load_answers(root / RESULTS / tag / "answers.jsonl")
    out = {}
    for budget in sorted(records["budget"].unique()):
        cal, conf = scored(records, float(budget))
        out[f"{budget:g}"] = {f"{r:g}": policy_outcomes(conf, cal, "certificate", r)[1] for r in THRESHOLD_RATES}
    return out


def ship_thresholds(root: Path = Path(".")) -> list[Path]:
    """Write each model's per-budget thresholds into its shipped calibration file (nothing else in it changes)."""
    from kvcert.serve.calibration import Calibration

    written = []
    for tag, name in MODELS.items():
        if not complete(tag, root):
            continue
        path = root / "src/kvcert/serve/calibrations" / f"{name}.json"
        cal = Calibration.load(path)
        cal.budget_thresholds = budget_thresholds(tag, root)
        cal.budget_thresholds_source = (
            "study 4's calibration split (30% by id hash; preregistration/study4/PLAN.md), "
            "python -m kvcert.studies.study4 thresholds"
        )
        written.append(cal.save(path))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("select", help="choose tasks and levels from the level pilot (PLAN.md section 2)")
    r = sub.add_parser("run", help="the confirmatory records of one model (resumable)")
    r.add_argument("--model", required=True, choices=sorted(MODELS))
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--regenerate", action="store_true", help="a full regeneration into <model>/regenerated/")
    a = sub.add_parser("analyze", help="claims and reports from complete records")
    a.add_argument("--partial", action="store_true", help="an interim look at incomplete records (not a result)")
    t = sub.add_parser("token-reference", help="today's token-level rule at P1's threshold (after the records)")
    t.add_argument("--model", required=True, choices=sorted(MODELS))
    g = sub.add_parser("regenerate-check", help="regenerate the first N recorded examples per model and compare")
    g.add_argument("-n", type=int, default=5)
    g.add_argument("--regenerated", action="store_true", help="compare the full regeneration (make reproduce)")
    sub.add_parser("thresholds", help="per-budget escalation thresholds into the shipped calibration files")
    d = sub.add_parser("derive", help="regeneration tolerances from measured float noise (threads, torch ops)")
    d.add_argument("-n", type=int, default=5)
    args = p.parse_args(argv)
    if args.cmd == "select":
        design = select()
        (PREREG / "design.yaml").write_text(yaml.safe_dump(design, sort_keys=False))
        print(yaml.safe_dump({t: m["tasks"] for t, m in design["models"].items()}), end="")
    elif args.cmd == "run":
        print(f"wrote {run(args.model, args.threads, regenerate=args.regenerate)}")
    elif args.cmd == "token-reference":
        print(f"wrote {token_reference(args.model)}")
    elif args.cmd == "thresholds":
        for path in ship_thresholds():
            print(f"wrote {path}")
    elif args.cmd == "derive":
        from kvcert.studies.study4.regeneration import TOLERANCES, derive_tolerances

        derived = derive_tolerances(args.n)
        (PREREG / TOLERANCES).write_text(json.dumps(derived, indent=2) + "\n")
        print(json.dumps(derived["models"], indent=1))
    elif args.cmd == "regenerate-check":
        from kvcert.studies.study4.regeneration import full_regeneration_check, regeneration_check

        ok = True
        for tag in MODELS:
            if (RESULTS / tag / "answers.jsonl").is_file():
                if args.regenerated:
                    passed, text = full_regeneration_check(tag)
                    (RESULTS / tag / "regeneration.md").write_text(text)
                else:
                    passed, text = regeneration_check(tag, args.n)
                    (RESULTS / tag / "regeneration_check.md").write_text(text)
                print(text)
                ok &= passed
        return 0 if ok else 1
    else:
        for tag, claims in analyze(partial=args.partial).items():
            for cid, c in claims.items():
                print(f"{tag} {cid}: {c['verdict']} {c['estimate']:.3g} [{c['lo']:.3g}, {c['hi']:.3g}]")
    return 0
