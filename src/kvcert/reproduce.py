"""Reproduce the studies end to end: (pilot -> lock ->) confirmatory runs -> published records -> analysis ->
scorecards.

    python -m kvcert.reproduce run --study all       # every claim experiment of each study, resumable; then T1
    python -m kvcert.reproduce publish --study all   # raw records -> results/<study>/published/ (committed)
    python -m kvcert.reproduce publish --study all --regenerated   # -> results/<study>/regenerated/ (compared)
    python -m kvcert.reproduce analyze --study all   # claims, tables, figures, scorecards from the published records
    python -m kvcert.reproduce smoke                 # run + publish + analyze on a tiny profile (< 3 minutes)
    python -m kvcert.reproduce pilot                 # study 1's pilot (seeds 1000+)

`make reproduce` runs `run`, `publish --regenerated`, the comparison of the regenerated records with the published
ones within the declared tolerances (kvcert.studies.regenerate full) and `analyze`, after the two lock checks;
`make analyze` runs the last alone (no model, no raw steps: under a minute; kvcert.studies.analyze). With studies
1 and 2 analysed, `combine` writes the combined scorecard results/scorecard.{json,md,html} (a column per study
analysed: study1, study2, study3_smollm2, study3_gemma3); each study's own scorecard is in its results folder
(results/study1/, results/study2/, results/study3/<model>/).

The claims, their order and their experiments come from the registry (kvcert.analysis.claims.registry: the ids of
preregistration/predictions.yaml, each with the conf/claim/*.yaml naming it). Claim experiments that state the same
data (model, tasks, policies, budgets, seed) share one results folder: the first runs it, the others find it
complete.

Studies (STUDIES, with PROFILES and settings in kvcert.studies.registry and re-exported here, so that
kvcert.studies.analyze reads them without importing this module; `--study`, default study1; the Makefile passes
`--study all`):

- study1: preregistration/predictions.yaml, conf/claim/*.yaml (top level only), out results/, lock
  preregistration/LOCK.json.
- study2: preregistration/study2/predictions.yaml, conf/claim/study2/*.yaml (composed as +claim=study2/<name>, each
  file `# @package _global_`), out results/study2/, lock
  preregistration/study2/LOCK.json. Its C1-C7 and T1 are analysed by the same locked code as study 1's (the same
  predictions schema); the secondary predictions S1-S5 and the combined scorecard are kvcert.studies.

- study3_smollm2, study3_gemma3: study 3 (preregistration/study3/PLAN.md), one entry per model under one lock
  (preregistration/study3/LOCK.json): predictions_<model>.yaml, conf/claim/study3/<model>/*.yaml, out
  results/study3/<model>/; threads 1 each, so `make study3` runs the two side by side. `analyze --study all` skips
  a study-3 model until its records are published, and adds the model-dependence table
  (kvcert.studies.model_dependence, results/study3/model_dependence.*) to results/scorecard.* once both are.

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

from kvcert.analysis.claims import registry
from kvcert.config import result_name
from kvcert.run import ROOT, config_dir, progress, run_cell
from kvcert.studies.analyze import _c1_entry, _is_t1, analyze, combine
from kvcert.studies.published import write_published
from kvcert.studies.registry import PREDICTIONS, PROFILES, STUDIES, STUDY3_C1_AND_S6C_ROWS, settings  # noqa: F401

CONF = config_dir()  # the checkout's conf/, or the copy in the installed wheel (compose_claim reads it)


def compose_claim(name: str, overrides: list[str] | None = None) -> DictConfig:
    """conf/config.yaml with +claim=<name> (a nested option such as study2/c1_coverage reads
    conf/claim/study2/c1_coverage.yaml) and the overrides."""
    import kvcert.run  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"+claim={name}", *(overrides or [])])


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


# ------------------------------------------------------------------------------------------------------- publish


def _relative(path: Path) -> Path:
    """A path relative to the repository when it lies inside it (published meta stays machine-independent), else
    as given (a results_dir such as /scratch/runs)."""
    path = Path(path)
    return path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path


def publish(profile: str = "confirmatory", *, study: str = "study1", into: Path | None = None) -> Path:
    """The study's published records (kvcert.studies.published) from its raw run folder: examples, the C1 cell
    table, the C1 cells above z(0.95), meta.json -> <out>/published/, or `into` (`make reproduce` publishes a
    regeneration into results/<study>/regenerated/ and compares it with the published records, which it never
    overwrites: kvcert.studies.regenerate)."""
    from kvcert.analysis import accuracy
    from kvcert.studies import cells as cell_table
    from kvcert.studies import published

    st = settings(study, profile)
    claims = registry(st["predictions"], st["claims"])
    c1 = _c1_entry(claims)
    cfg = compose_claim(st["prefix"] + c1.experiment, st["overrides"])
    run_dir = Path(cfg.results_dir) / result_name(cfg)
    if not (run_dir / "examples.parquet").exists() or not (run_dir / "steps.parquet").exists():
        raise FileNotFoundError(
            f"no complete records in {run_dir}; run `python -m kvcert.reproduce run --study {study}` first"
        )
    examples = pd.read_parquet(run_dir / "examples.parquet")
    rows = dict(st.get("publish_rows") or c1.spec["rows"])  # study 3 also publishes S6c's rows beside C1's
    selected = accuracy.select_rows(examples, rows)
    variants = sorted(
        {
            *selected.loc[selected["has_certificate"].astype(bool), "variant"],
            *cell_table.full_cache_rows(examples).variant,
        }
    )
    _, steps = cell_table.read_run(run_dir, variants)
    floor = cell_table.numerical_floor_from_steps(examples, steps)
    multipliers_path = st.get("multipliers")
    multipliers = cell_table.read_multipliers(multipliers_path) if multipliers_path else None
    cells, n_excluded = cell_table.coverage_cells(
        examples, steps, rows=rows, multipliers=multipliers, numerical_floor=floor
    )
    exceed = published.exceedances(published.c1_cells(examples, steps, rows))
    run_rel = _relative(run_dir)
    meta = {
        "study": study,
        "run": run_rel.as_posix(),
        "c1_rows": rows,
        "numerical_floor": floor,
        "excluded_cells": int(n_excluded),
        "multipliers": _relative(Path(multipliers_path)).as_posix() if multipliers_path else None,
        "n_c1_cells": int(cells["n_cells"].sum()),
        "n_exceedances": int(len(exceed)),
    }
    out = Path(into) if into is not None else st["published"]
    write_published(out, examples=examples, cells=cells, exceed=exceed, meta=meta)
    progress(
        f"{study}: published {meta['n_c1_cells']} C1 cells ({len(cells)} groups) -> {out}", st["out"] / "reproduce.log"
    )
    return out


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
    parser.add_argument("command", choices=["run", "publish", "analyze", "pilot", "smoke"])
    parser.add_argument("--profile", default="confirmatory", choices=sorted(PROFILES))
    parser.add_argument("--only", nargs="*", help="claim ids to run (default: all)")
    parser.add_argument("--study", default="study1", choices=[*STUDIES, "all"], help="default: study1")
    parser.add_argument(
        "--regenerated",
        action="store_true",
        help="publish: write results/<study>/regenerated/ (compared with the published records) instead",
    )
    args = parser.parse_args(argv)
    studies = list(STUDIES) if args.study == "all" else [args.study]
    from kvcert.config import ConfigError
    from kvcert.hf.model_support import ModelLoadError
    from kvcert.tasks import TaskError

    try:
        if args.command == "pilot":
            pilot()  # study 1's pilot (study 2 has none: its design is study 1's, locked)
            return 0
        profile = "smoke" if args.command == "smoke" else args.profile
        cards = {}
        for study in studies:
            if args.command in ("run", "smoke"):
                run_claims(profile, args.only, study=study)
            if args.command in ("publish", "smoke"):
                into = settings(study, profile)["scorecard"] / "regenerated" if args.regenerated else None
                publish(profile, study=study, into=into)
            if args.command in ("analyze", "smoke"):
                published_dir = settings(study, profile)["published"]
                if args.command == "analyze" and study.startswith("study3") and not published_dir.exists():
                    # study 3 is analysed once its records are published; studies 1-2 do not wait for it
                    print(f"[kvcert] {study}: no published records in {published_dir} yet; skipped")
                    continue
                cards[study] = analyze(profile, study=study)
        if {"study1", "study2"} <= set(cards):
            combine(cards, profile)
    except (ConfigError, ModelLoadError, TaskError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
