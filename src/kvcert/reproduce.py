"""Reproduce the seven claims and T1 end to end: pilot -> lock -> confirmatory runs -> analysis -> scorecard.

    python -m kvcert.reproduce pilot      # the pilot that chose the locked design parameters (seeds 1000+)
    python -m kvcert.reproduce run        # every claim experiment (conf/claim/*.yaml), resumable; then T1
    python -m kvcert.reproduce analyze    # tables, figures, scorecard from the records (pure functions)
    python -m kvcert.reproduce smoke      # run + analyze on a tiny profile into results/smoke/ (< 3 minutes)

The claims, their order and their experiments come from the registry (kvcert.analysis.claims.registry: the ids of
preregistration/predictions.yaml, each with the conf/claim/*.yaml naming it). Claim experiments that state the same
data (model, tasks, policies, budgets, seed) share one results folder: the first runs it, the others find it
complete.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from kvcert.analysis.claims import ClaimResult, registry
from kvcert.config import result_name
from kvcert.run import ROOT, run_cell

CONF = ROOT / "conf"
PREDICTIONS = ROOT / "preregistration" / "predictions.yaml"
PROFILES = {
    # study 1 decodes through the path that produced its locked results (two decode batches, finished rows kept in
    # the batch): the speed switches change float rounding, and its records must be regenerated bit for bit
    "confirmatory": {"out": ROOT / "results", "overrides": ["decode.one_batch=false", "decode.drop_finished=false"]},
    # tiny data, same grid: exercises every design and every analysis, verdicts mostly inconclusive
    "smoke": {
        "out": ROOT / "results" / "smoke",
        "overrides": [
            "task.n_examples=1",
            "task.context_tokens=[400]",
            "decode.max_new_tokens=10",
            "results_dir=results/smoke/runs",
        ],
        "t1_draws": 400,
    },
}


def compose_claim(name: str, overrides: list[str] | None = None) -> DictConfig:
    import kvcert.run  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"+claim={name}", *(overrides or [])])


def _is_t1(spec: dict) -> bool:
    return spec.get("analysis") == "t1"


# ------------------------------------------------------------------------------------------------------------ T1
def t1_from_config(cfg: DictConfig, draws: int | None = None) -> dict:
    """kvcert.core.t1.t1_demonstration with the parameters of conf/claim/t1_nonidentifiability.yaml and the locked
    design (cfg.policy); `draws` replaces the configured number of design draws."""
    from kvcert.core.t1 import t1_demonstration

    t = cfg.claim.t1
    return t1_demonstration(
        lambdas=list(t.lambdas),
        n=int(t.n),
        d=int(t.d),
        budget=float(t.budget),
        peakedness=float(t.peakedness),
        draws=int(draws or t.draws),
        seed=int(t.seed),
        tail_fraction=float(cfg.policy.tail_fraction),
        floor=float(cfg.policy.floor),
        score_power=float(cfg.policy.score_power),
    )


# ----------------------------------------------------------------------------------------------------------- run
def run_claims(profile: str = "confirmatory", only: list[str] | None = None) -> None:
    prof = PROFILES[profile]
    out = Path(prof["out"])
    (out / "tables").mkdir(parents=True, exist_ok=True)
    for cid, entry in registry(PREDICTIONS, CONF / "claim").items():
        if only and cid not in only:
            continue
        cfg = compose_claim(entry.experiment, prof["overrides"])
        started = time.perf_counter()
        if _is_t1(entry.spec):
            result = t1_from_config(cfg, prof.get("t1_draws"))
            (out / "tables" / "t1.json").write_text(json.dumps(result, indent=2))
            print(f"[kvcert] {cid}: {len(result['lambda'])} lambdas in {time.perf_counter() - started:.0f}s")
            continue
        print(f"[kvcert] {cid} ({entry.experiment}) -> {Path(cfg.results_dir) / result_name(cfg)}")
        run_cell(cfg)


# ------------------------------------------------------------------------------------------------------- analyze
def _load_records(run_dir: Path, cache: dict) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    if run_dir not in cache:
        if not (run_dir / "examples.parquet").exists():
            raise FileNotFoundError(f"no records in {run_dir}; run `python -m kvcert.reproduce run` first")
        steps = run_dir / "steps.parquet"
        cache[run_dir] = (
            pd.read_parquet(run_dir / "examples.parquet"),
            pd.read_parquet(steps) if steps.exists() else None,
        )
    return cache[run_dir]


def analyze(profile: str = "confirmatory") -> dict:
    from kvcert.prereg import verify

    prof = PROFILES[profile]
    out = Path(prof["out"])
    claims = registry(PREDICTIONS, CONF / "claim")
    cache: dict = {}
    records = {}
    for cid, entry in claims.items():
        if not _is_t1(entry.spec):
            cfg = compose_claim(entry.experiment, prof["overrides"])
            records[cid] = _load_records(Path(cfg.results_dir) / result_name(cfg), cache)
    t1_path = out / "tables" / "t1.json"
    t1 = json.loads(t1_path.read_text()) if t1_path.exists() else None
    runs = sorted({str(p.relative_to(ROOT)) if p.is_absolute() else str(p) for p in cache})
    predictions = {cid: entry.spec for cid, entry in claims.items()}
    return analyze_records(records, t1, predictions, out, verify(ROOT), profile=profile, runs=runs)


def analyze_records(
    records: dict[str, tuple[pd.DataFrame, pd.DataFrame | None]],
    t1: dict | None,
    predictions: dict[str, dict],
    out: Path,
    lock_status: dict,
    *,
    profile: str,
    runs: list[str],
) -> dict:
    """Claims, tables, figures and the scorecard from records already loaded (claim id -> (examples, steps)),
    the T1 result and the lock status: everything `analyze` writes, with no config or file lookup. The claims
    and their order are those of `predictions` (predictions.yaml's claims mapping)."""
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
                results[cid] = evaluate_t1(t1, spec)
            continue
        examples, steps = records[cid]
        main_records = main_records or (examples, steps)
        started = time.perf_counter()
        r = results[cid] = evaluate_claim(cid, examples, steps if spec["analysis"] == "coverage" else None, spec)
        print(
            f"[kvcert] {cid}: {r.verdict:12s} observed {r.observed} CI {r.ci} "
            f"(paper: {r.paper_verdict}) [{time.perf_counter() - started:.1f}s]"
        )
    figures = make_figures(results, main_records[0] if main_records else None, t1, out / "figures")
    if main_records:
        write_tables(*main_records, out, n_boot=500)
    for cid, r in results.items():
        (out / "tables").mkdir(parents=True, exist_ok=True)
        (out / "tables" / f"claim_{cid.lower()}.json").write_text(json.dumps(jsonable(r.as_dict()), indent=2))
    card = build_scorecard(list(results.values()), lock_status, ids=list(predictions))
    card["profile"] = profile
    card["runs"] = runs
    paths = write_scorecard(card, out, [Path(f) for f in figures])
    print(f"[kvcert] scorecard: {paths['md']}")
    return card


# --------------------------------------------------------------------------------------------------------- pilot
def pilot() -> None:
    """The pilot cell (disjoint seeds, every candidate design setting as a variant); writes results/pilot/summary."""
    from kvcert.analysis.pilot import pilot_summary, write_pilot_summary

    run_dir = run_cell(compose_claim("pilot"))
    table = pilot_summary(pd.read_parquet(run_dir / "examples.parquet"), pd.read_parquet(run_dir / "steps.parquet"))
    write_pilot_summary(table, ROOT / "results" / "pilot")
    print(table.to_string(index=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["run", "analyze", "pilot", "smoke"])
    parser.add_argument("--profile", default="confirmatory", choices=sorted(PROFILES))
    parser.add_argument("--only", nargs="*", help="claim ids to run (default: all)")
    args = parser.parse_args(argv)
    from kvcert.config import ConfigError
    from kvcert.hf.loading import ModelLoadError
    from kvcert.tasks import TaskError

    try:
        if args.command == "run":
            run_claims(args.profile, args.only)
        elif args.command == "analyze":
            analyze(args.profile)
        elif args.command == "pilot":
            pilot()
        else:
            run_claims("smoke")
            analyze("smoke")
    except (ConfigError, ModelLoadError, TaskError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
