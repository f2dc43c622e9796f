"""Reproduce the seven claims and T1 end to end: pilot -> lock -> confirmatory runs -> analysis -> scorecard.

    python -m kvcert.reproduce pilot      # the pilot that chose the locked design parameters (seeds 1000+)
    python -m kvcert.reproduce run        # every claim experiment (conf/claim/*.yaml), resumable; then T1
    python -m kvcert.reproduce analyze    # tables, figures, scorecard from the records (pure functions)
    python -m kvcert.reproduce smoke      # run + analyze on a tiny profile into results/smoke/ (< 3 minutes)

    python -m kvcert.reproduce run --study study2      # study 2 (conf/claim/study2/*.yaml) into results/study2/
    python -m kvcert.reproduce analyze --study all     # study 1, then study 2

The claims, their order and their experiments come from the registry (kvcert.analysis.claims.registry: the ids of
preregistration/predictions.yaml, each with the conf/claim/*.yaml naming it). Claim experiments that state the same
data (model, tasks, policies, budgets, seed) share one results folder: the first runs it, the others find it
complete.

Studies (STUDIES; `--study`, default study1, so `make reproduce` is study 1 until it passes --study):

- study1: preregistration/predictions.yaml, conf/claim/*.yaml (top level only), out results/, the decode path that
  produced its locked records (decode.one_batch=false, decode.drop_finished=false), lock preregistration/LOCK.json.
- study2: preregistration/study2/predictions.yaml, conf/claim/study2/*.yaml (composed as +claim=study2/<name>, each
  file `# @package _global_`), out results/study2/, the fast decode path (one_batch, drop_finished), lock
  preregistration/study2/LOCK.json. Its C1-C7 and T1 are analysed by the same locked code as study 1's (the same
  predictions schema); the secondary predictions S1-S5 and the two-study scorecard are kvcert.studies.

Each study pins `threads` (a `threads=N` override) for every step, T1 included (torch.set_num_threads before the
demonstration; before this it inherited whatever ran last). `run` appends timestamped progress to
<out>/reproduce.log: a line per claim (start, done with wall seconds) and, through run_cell(log=), the cell's start,
every shard with its ETA, and complete / skipped-because-complete.
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
from kvcert.run import ROOT, progress, run_cell

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

STUDIES: dict[str, dict] = {
    "study1": {
        "predictions": PREDICTIONS,
        "claims": CONF / "claim",  # top-level *.yaml only (registry's glob): conf/claim/study2/ is not study 1's
        "prefix": "",  # the claim group option is <prefix><file stem>
        "out": ROOT / "results",
        "overrides": PROFILES["confirmatory"]["overrides"],
        "threads": 2,  # conf/config.yaml's default, which produced the locked records
        "lock": "study1",  # kvcert.prereg.STUDIES
    },
    "study2": {
        "predictions": ROOT / "preregistration" / "study2" / "predictions.yaml",
        "claims": CONF / "claim" / "study2",
        "prefix": "study2/",
        "out": ROOT / "results" / "study2",
        "overrides": ["decode.one_batch=true", "decode.drop_finished=true"],
        "threads": 1,  # single-thread workers (PLAN.md section 4, wall time)
        "lock": "study2",
    },
}


def settings(study: str = "study1", profile: str = "confirmatory") -> dict:
    """The study's entry with the profile applied: predictions, claims (conf dir), prefix, out, overrides (ending
    with threads=N), threads, lock, t1_draws. Study 1 under a profile is exactly that profile, as before."""
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}; choose one of {sorted(STUDIES)}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    st = dict(STUDIES[study])
    st["out"] = Path(st["out"])
    if profile != "confirmatory":
        prof = PROFILES[profile]
        if study == "study1":
            st["out"], overrides = Path(prof["out"]), list(prof["overrides"])
        else:  # the study's own path and decode switches, the profile's tiny data, under <out>/<profile>
            st["out"] = st["out"] / profile
            tiny = [o for o in prof["overrides"] if not o.startswith("results_dir=")]
            overrides = [*st["overrides"], *tiny, f"results_dir={st['out'] / 'runs'}"]
        st["overrides"] = overrides
        st["t1_draws"] = prof.get("t1_draws")
    st["overrides"] = [*st["overrides"], f"threads={int(st['threads'])}"]
    st.setdefault("t1_draws", None)
    return st


def compose_claim(name: str, overrides: list[str] | None = None) -> DictConfig:
    """conf/config.yaml with +claim=<name> (a nested option such as study2/c1_coverage reads
    conf/claim/study2/c1_coverage.yaml) and the overrides."""
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
def run_claims(profile: str = "confirmatory", only: list[str] | None = None, *, study: str = "study1") -> None:
    """Every claim experiment of the study (resumable), then T1; progress appended to <out>/reproduce.log."""
    import torch

    st = settings(study, profile)
    out = st["out"]
    log = out / "reproduce.log"
    (out / "tables").mkdir(parents=True, exist_ok=True)
    claims = registry(st["predictions"], st["claims"])
    progress(f"{study} ({profile}): {len(claims)} claims, {st['threads']} threads -> {out}", log)
    for cid, entry in claims.items():
        if only and cid not in only:
            continue
        cfg = compose_claim(st["prefix"] + entry.experiment, st["overrides"])
        started = time.perf_counter()
        if _is_t1(entry.spec):
            torch.set_num_threads(int(cfg.threads))
            progress(f"{cid} ({entry.experiment}): start, {int(cfg.threads)} threads", log, echo=False)
            result = t1_from_config(cfg, st["t1_draws"])
            (out / "tables" / "t1.json").write_text(json.dumps(result, indent=2))
            progress(f"{cid}: {len(result['lambda'])} lambdas in {time.perf_counter() - started:.0f}s", log)
            continue
        progress(f"{cid} ({entry.experiment}) -> {Path(cfg.results_dir) / result_name(cfg)}", log)
        run_cell(cfg, log=log)
        progress(f"{cid}: done in {time.perf_counter() - started:.0f}s", log, echo=False)


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


def analyze(profile: str = "confirmatory", *, study: str = "study1") -> dict:
    """The study's claims from its records: tables, figures and its own scorecard under its out folder, with its
    own lock status (kvcert.prereg.verify(study=...))."""
    from kvcert.prereg import verify

    st = settings(study, profile)
    out = st["out"]
    claims = registry(st["predictions"], st["claims"])
    cache: dict = {}
    records = {}
    for cid, entry in claims.items():
        if not _is_t1(entry.spec):
            cfg = compose_claim(st["prefix"] + entry.experiment, st["overrides"])
            records[cid] = _load_records(Path(cfg.results_dir) / result_name(cfg), cache)
    t1_path = out / "tables" / "t1.json"
    t1 = json.loads(t1_path.read_text()) if t1_path.exists() else None
    runs = sorted({str(p.relative_to(ROOT)) if p.is_absolute() else str(p) for p in cache})
    predictions = {cid: entry.spec for cid, entry in claims.items()}
    return analyze_records(records, t1, predictions, out, verify(ROOT, study=st["lock"]), profile=profile, runs=runs)


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
    parser.add_argument("--study", default="study1", choices=[*STUDIES, "all"], help="default: study1")
    args = parser.parse_args(argv)
    studies = list(STUDIES) if args.study == "all" else [args.study]
    from kvcert.config import ConfigError
    from kvcert.hf.loading import ModelLoadError
    from kvcert.tasks import TaskError

    try:
        if args.command == "pilot":
            pilot()  # study 1's pilot (study 2 has none: its design is study 1's, locked)
            return 0
        for study in studies:
            if args.command == "run":
                run_claims(args.profile, args.only, study=study)
            elif args.command == "analyze":
                analyze(args.profile, study=study)
            else:
                run_claims("smoke", study=study)
                analyze("smoke", study=study)
    except (ConfigError, ModelLoadError, TaskError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
