"""Analyze the studies from their published records (`python -m kvcert.reproduce analyze`, `make analyze`: no model,
no raw steps): each study's claims, tables, figures and own scorecard (analyze, analyze_records), the secondary
predictions of studies 2 and 3, the combined scorecard results/scorecard.{json,md,html} (combine) and study 3's
model-dependence table (model_dependence_rows); the studies' settings are kvcert.studies.registry.settings."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from kvcert.analysis.claims import ClaimResult, registry
from kvcert.run import ROOT
from kvcert.studies.published import load_published
from kvcert.studies.registry import STUDIES, settings

# N each claim needs for its decision margin (PLAN.md section 4, from study 1's per-example SDs)
STUDY2_POWER_TARGET_N = {"C1": 13, "C2": 119, "C3": 273, "C4": 249, "C5": 304, "C6": 237, "C7": 354}


def _is_t1(spec: dict) -> bool:
    return spec.get("analysis") == "t1"


def _c1_entry(claims: dict):
    entries = [e for e in claims.values() if e.analysis == "coverage"]
    if len(entries) != 1:
        raise ValueError(f"expected one coverage claim in the predictions, found {len(entries)}")
    return entries[0]


def analyze(profile: str = "confirmatory", *, study: str = "study1") -> dict:
    """The study's claims from its published records (no model, no raw steps): tables, figures and its own
    scorecard (<out>/scorecard.* for study 2, results/study1/ for study 1), with its own lock status; study 2
    adds S1-S5 (kvcert.studies.secondary) to its scorecard and to tables/secondary.json."""
    import yaml

    from kvcert.analysis.scorecard import jsonable
    from kvcert.prereg import verify
    from kvcert.studies import published

    st = settings(study, profile)
    out = st["out"]
    claims = registry(st["predictions"], st["claims"])
    pub, steps = published_records(st["published"])
    meta = pub["meta"]
    c1 = _c1_entry(claims)
    published.check_conformal_exact(steps, int(c1.spec.get("conformal_seed", 0)))
    records = {cid: (pub["examples"], steps) for cid, entry in claims.items() if not _is_t1(entry.spec)}
    t1_path = out / "tables" / "t1.json"
    t1 = json.loads(t1_path.read_text()) if t1_path.exists() else None
    predictions = {cid: entry.spec for cid, entry in claims.items()}
    t1_evaluator = None
    if study == "study2":
        from kvcert.studies.t1 import evaluate_t1_study2 as t1_evaluator
    card = analyze_records(
        records,
        t1,
        predictions,
        out,
        verify(ROOT, study=st["lock"]),
        profile=profile,
        runs=[meta["run"]],
        step_tables=False,
        t1_evaluator=t1_evaluator,
        scorecard_dir=st["scorecard"],
    )
    if study == "study2" or study.startswith("study3"):
        from kvcert.studies.secondary import evaluate_secondary

        document = yaml.safe_load(Path(st["predictions"]).read_text())
        secondary = evaluate_secondary(pub["examples"], pub["cells"], document)
        for sid, result in secondary.items():  # the pre-registered wording beside each result
            entry = (document.get("secondary") or {}).get(sid) or {}
            result.setdefault("prediction", " ".join(str(entry.get(k, "")) for k in ("claim", "prediction")).strip())
            if result.get("status") is None:  # S3's pre-declared check; S5 is descriptive
                result["status"] = f"check: {result['check']}" if result.get("check") else "descriptive"
        if study.startswith("study3"):  # S6 and C5 (descriptive), by the locked claim code on the same records
            from kvcert.studies.study3 import evaluate_study3_secondary

            secondary |= evaluate_study3_secondary(pub["examples"], steps, document)
        (out / "tables" / "secondary.json").write_text(json.dumps(jsonable(secondary), indent=2) + "\n")
        card["secondary"] = secondary
    card["n_examples"] = int(pub["examples"]["example_id"].nunique())
    return card


@functools.lru_cache(maxsize=2)  # the last two: study 3's models, which the model-dependence table reads again
def published_records(published_dir: Path) -> tuple[dict, pd.DataFrame]:
    """A study's published records and the synthetic C1 steps built from them (kvcert.studies.published), loaded
    once per process: `analyze` and the model-dependence table read the same ones. Callers must not modify them."""
    from kvcert.studies import published

    pub = load_published(published_dir)
    return pub, published.synthetic_steps(pub["cells"], pub["exceedances"])


def combine(cards: dict[str, dict], profile: str = "confirmatory") -> dict:
    """The combined scorecard (kvcert.studies.scorecard) -> results/scorecard.{json,md,html} (the profile's
    study-1 out folder), with study 2's power targets (PLAN.md section 4)."""
    from kvcert.studies.scorecard import combined_scorecard, write_combined
    from kvcert.studies.study4.cli import scorecard_cards
    from kvcert.studies.study5.cli import scorecard_cards as study5_cards

    # studies 4's and 5's columns, once their records are complete
    cards = {**cards, **scorecard_cards(ROOT), **study5_cards(ROOT)}

    power = {cid: {"target_n": n} for cid, n in STUDY2_POWER_TARGET_N.items()} if "study2" in cards else None
    secondary = cards.get("study2", {}).get("secondary")
    study3 = [sid for sid in cards if sid.startswith("study3")]
    dependence = None
    if len(study3) == 2:  # both models analysed: the model-dependence table (PLAN.md section 6)
        dependence = model_dependence_rows(profile).to_dict("records")
    card = combined_scorecard(
        cards,
        secondary=secondary,
        power=power,
        study_secondary={sid: cards[sid]["secondary"] for sid in study3 if cards[sid].get("secondary")},
        model_dependence=dependence,
    )
    out = settings("study1", profile)["out"]
    figures = [Path(f) for c in cards.values() for f in c.get("figures", [])]
    paths = write_combined(card, out, figures)
    for sid in cards:  # every study's claims, studies 4 and 5 included (their analysis prints none here)
        if not sid.startswith(("study1", "study2", "study3")):
            for c in card["studies"][sid]["claims"]:
                print(f"[kvcert] {sid} {c['id']}: {claim_line(c)}")
    print(f"[kvcert] combined scorecard: {paths['md']}")
    return card


def claim_line(claim: dict) -> str:
    """ "refuted      observed 0.914 [0.911, 0.916] (paper: supported)": the scorecard's rounding (3 decimals, 1 for
    points)."""
    from kvcert.analysis.scorecard import _fmt

    unit = str(claim.get("unit") or "")
    ci = claim.get("ci") or [None, None]
    if claim.get("evaluated", True) is False:
        return "not evaluated"
    est = f"{_fmt(claim.get('observed'), unit)} [{_fmt(ci[0], unit)}, {_fmt(ci[1], unit)}]" + (
        f" {unit}" if unit else ""
    )
    return f"{str(claim.get('verdict')):12s} observed {est} (paper: {claim.get('paper_verdict') or 'n/a'})"


def model_dependence_rows(profile: str = "confirmatory") -> pd.DataFrame:
    """Study 3's model-dependence table (kvcert.studies.study3.study3_report) from both models' published records
    and claim results -> results/study3/model_dependence.{csv,md}."""
    import yaml

    from kvcert.studies.study3 import study3_report

    records, documents, cards = {}, {}, {}
    for sid in ("study3_smollm2", "study3_gemma3"):
        st = settings(sid, profile)
        pub, steps = published_records(st["published"])  # as `analyze` loaded them a moment before
        records[sid] = (pub["examples"], steps)
        documents[sid] = yaml.safe_load(Path(st["predictions"]).read_text())
        claims_dir = st["out"] / "tables"
        cards[sid] = {
            "claims": [json.loads(p.read_text()) for p in sorted(claims_dir.glob("claim_c*.json"))],
        }
    # beside the models' folders (results/study3/ for the confirmatory profile), not under a fixed path: a study
    # redirected elsewhere (a test's temporary tree, a user's results folder) keeps its table in its own tree
    out = Path(STUDIES["study3_smollm2"]["out"]).parent / ("" if profile == "confirmatory" else profile)
    return study3_report(records, documents, cards, out)


def analyze_records(
    records: dict[str, tuple[pd.DataFrame, pd.DataFrame | None]],
    t1: dict | None,
    predictions: dict[str, dict],
    out: Path,
    lock_status: dict,
    *,
    profile: str,
    runs: list[str],
    step_tables: bool = True,
    t1_evaluator: Callable | None = None,
    scorecard_dir: Path | None = None,
) -> dict:
    """Claims, tables, figures and the scorecard from records already loaded (claim id -> (examples, steps)),
    the T1 result and the lock status: everything `analyze` writes, with no config or file lookup. The claims
    and their order are those of `predictions` (predictions.yaml's claims mapping).

    step_tables=False leaves the descriptive step tables (coverage_by_*.csv, calibration_by_design.csv: every
    certified variant) as they are: published records hold the C1 cells only. t1_evaluator replaces study 1's
    evaluate_t1 (study 2 adds a check); scorecard_dir (default `out`) is where scorecard.{json,md,html} go."""
    from kvcert.analysis.claims import evaluate_claim, evaluate_t1
    from kvcert.analysis.figures import make_figures
    from kvcert.analysis.scorecard import build_scorecard, jsonable, write_scorecard
    from kvcert.analysis.tables import write_tables

    out = Path(out)
    results: dict[str, ClaimResult] = {}
    main_records = None
    for cid, spec in predictions.items():
        if _is_t1(spec):
            if t1 is not None:
                results[cid] = (t1_evaluator or evaluate_t1)(t1, spec)
            continue
        examples, steps = records[cid]
        main_records = main_records or (examples, steps)
        started = time.perf_counter()
        r = results[cid] = evaluate_claim(cid, examples, steps if spec["analysis"] == "coverage" else None, spec)
        print(f"[kvcert] {cid}: {claim_line(r.as_dict())} [{time.perf_counter() - started:.1f}s]")
    figures = make_figures(results, main_records[0] if main_records else None, t1, out / "figures")
    if main_records:
        write_tables(main_records[0], main_records[1] if step_tables else None, out, n_boot=500)
    for cid, r in results.items():
        (out / "tables").mkdir(parents=True, exist_ok=True)
        (out / "tables" / f"claim_{cid.lower()}.json").write_text(json.dumps(jsonable(r.as_dict()), indent=2))
    card = build_scorecard(list(results.values()), lock_status, ids=list(predictions))
    card["profile"] = profile
    card["runs"] = runs
    paths = write_scorecard(card, scorecard_dir or out, [Path(f) for f in figures])
    card["figures"] = [str(f) for f in figures]
    print(f"[kvcert] scorecard: {paths['md']}")
    return card
