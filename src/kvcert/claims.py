"""The seven claims and T1 end to end: pilot -> lock -> confirmatory runs -> analysis -> scorecard + figures.

    python -m kvcert.claims pilot      # the pilot that chose the locked design parameters (seeds 1000+)
    python -m kvcert.claims run        # every claim experiment (conf/claim/*.yaml), resumable; then T1
    python -m kvcert.claims analyze    # tables, figures, scorecard from the records (pure functions)
    python -m kvcert.claims smoke      # run + analyze on a tiny profile into results/smoke/ (< 3 minutes)

Claim experiments that state the same data (model, tasks, policies, budgets, seed) share one results folder: the
first runs it, the others find it complete.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from kvcert.config import result_name
from kvcert.run import ROOT, run_cell

CONF = ROOT / "conf"
CLAIMS = {
    "C1": "c1_coverage",
    "C2": "c2_randomization_cost",
    "C3": "c3_question_aware",
    "C4": "c4_failure_prediction",
    "C5": "c5_escalation",
    "C6": "c6_attribution",
    "C7": "c7_recompute",
    "T1": "t1_nonidentifiability",
}
PROFILES = {
    "confirmatory": {"out": ROOT / "results", "overrides": []},
    # tiny data, same grid: exercises every design and every analysis, verdicts mostly inconclusive
    "smoke": {"out": ROOT / "results" / "smoke",
              "overrides": ["task.n_examples=1", "task.context_tokens=[400]", "decode.max_new_tokens=10",
                            "results_dir=results/smoke/runs"], "t1_draws": 400},
}


def compose_claim(name: str, overrides: list[str] | None = None) -> DictConfig:
    import kvcert.run  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"+claim={name}", *(overrides or [])])


# ------------------------------------------------------------------------------------------------------------ T1
def t1_demonstration(cfg: DictConfig, draws: int | None = None) -> dict:
    """The non-identifiability construction on a random attention problem (kvcert.core only)."""
    from kvcert.core import evicted_mask, exact_attention, gather_tokens, get_design, hajek_attention, perturb_values
    from kvcert.core.selection import split_head_tail
    from kvcert.core.simulate import monte_carlo, random_problem

    t = cfg.claim.t1
    g = torch.Generator().manual_seed(int(t.seed))
    p = random_problem(n=int(t.n), d=int(t.d), peakedness=float(t.peakedness), generator=g)
    n_keep = round(float(t.budget) * int(t.n))
    det = get_design("topk")(p.scores[None], n_keep)
    evicted = evicted_mask(det.indices, det.valid, int(t.n))[0]
    kept_k = gather_tokens(p.keys[None], det.indices)

    def det_output(values):
        kept_v = gather_tokens(values[None], det.indices)
        res = hajek_attention(p.query[None, None], kept_k, kept_v, det.offset.double(), scale=p.scale,
                              one_minus_pi=det.one_minus_pi.double())
        return res.output[0, 0], float(res.variance[0, 0]), kept_v

    o0, _, _ = det_output(p.values)
    exact0 = exact_attention(p.query[None, None], p.keys[None], p.values[None], scale=p.scale)[0, 0]
    # push the evicted values along the current error: the true error then grows monotonically with lambda
    direction = (exact0 - o0) / (exact0 - o0).norm()
    n_head, _ = split_head_tail(n_keep, float(cfg.policy.tail_fraction))
    non_head = torch.ones(int(t.n), dtype=torch.bool)
    non_head[p.scores.topk(n_head).indices] = False
    out = {k: [] for k in ["lambda", "true_error_deterministic", "estimate_deterministic", "retained_identical",
                           "mse_randomized", "mean_vhat_randomized", "coverage_randomized"]}
    _, _, kept_ref = det_output(p.values)
    for lam in t.lambdas:
        v_det = perturb_values(p.values, evicted, direction, float(lam))
        o_hat, v_hat_det, kept_v = det_output(v_det)
        exact = exact_attention(p.query[None, None], p.keys[None], v_det[None], scale=p.scale)[0, 0]
        v_rand = perturb_values(p.values, non_head, direction, float(lam))
        mc = monte_carlo(p, budget=float(t.budget), tail_fraction=float(cfg.policy.tail_fraction),
                         floor=float(cfg.policy.floor), score_power=float(cfg.policy.score_power),
                         draws=int(draws or t.draws), generator=torch.Generator().manual_seed(int(t.seed) + 1),
                         values=v_rand)
        out["lambda"].append(float(lam))
        out["true_error_deterministic"].append(float((o_hat - exact).norm()))
        out["estimate_deterministic"].append(v_hat_det)  # the certificate of top-k: 0 whatever lambda is
        out["retained_identical"].append(bool(torch.equal(kept_v, kept_ref)))
        out["mse_randomized"].append(mc["mse"])
        out["mean_vhat_randomized"].append(mc["mean_vhat"])
        out["coverage_randomized"].append(mc["coverage"])
    return out


# ----------------------------------------------------------------------------------------------------------- run
def run_claims(profile: str = "confirmatory", only: list[str] | None = None) -> None:
    prof = PROFILES[profile]
    out = Path(prof["out"])
    (out / "tables").mkdir(parents=True, exist_ok=True)
    for cid, name in CLAIMS.items():
        if only and cid not in only:
            continue
        cfg = compose_claim(name, prof["overrides"])
        started = time.perf_counter()
        if cid == "T1":
            result = t1_demonstration(cfg, prof.get("t1_draws"))
            (out / "tables" / "t1.json").write_text(json.dumps(result, indent=2))
            print(f"[kvcert] T1: {len(result['lambda'])} lambdas in {time.perf_counter() - started:.0f}s")
            continue
        print(f"[kvcert] {cid} ({name}) -> {Path(cfg.results_dir) / result_name(cfg)}")
        run_cell(cfg)


# ------------------------------------------------------------------------------------------------------- analyze
def _load_records(run_dir: Path, cache: dict) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    if run_dir not in cache:
        if not (run_dir / "examples.parquet").exists():
            raise FileNotFoundError(f"no records in {run_dir}; run `python -m kvcert.claims run` first")
        steps = run_dir / "steps.parquet"
        cache[run_dir] = (pd.read_parquet(run_dir / "examples.parquet"),
                          pd.read_parquet(steps) if steps.exists() else None)
    return cache[run_dir]


def write_tables(examples: pd.DataFrame, steps: pd.DataFrame | None, out: Path, n_boot: int) -> list[Path]:
    """The descriptive tables beside the claims (CSV)."""
    from kvcert.analysis.accuracy import accuracy_vs_budget
    from kvcert.analysis.coverage import calibration_curve, coverage_table, steps_for

    tables = out / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    written = []
    acc = accuracy_vs_budget(examples, n_boot=n_boot)
    acc.to_csv(tables / "accuracy_vs_budget.csv", index=False)
    written.append(tables / "accuracy_vs_budget.csv")
    summary = (examples.groupby(["scorer", "design", "budget"], dropna=False)
               .agg(n=("correct", "size"), accuracy=("correct", "mean"), kept_tokens=("kept_tokens", "mean"),
                    cert_score=("cert_score", "mean"), rel_error=("rel_error_mean", "mean"),
                    covered95=("covered95", "mean"), logprob=("logprob_mean", "mean"))
               .reset_index())
    summary.to_csv(tables / "variants.csv", index=False)
    written.append(tables / "variants.csv")
    if steps is not None and len(steps):
        s = steps_for(examples, steps)
        meta = examples.drop_duplicates("variant").set_index("variant")[["design", "scorer", "budget"]]
        s = s.join(meta, on="variant")
        cert = s[np.isfinite(s.variance)]
        for by in (["design", "scorer", "budget"], ["design", "layer"], ["design", "budget", "layer"]):
            name = "coverage_by_" + "_".join(by) + ".csv"
            coverage_table(cert, by=by, n_boot=min(n_boot, 200)).to_csv(tables / name, index=False)
            written.append(tables / name)
        calib = [calibration_curve(g).assign(design=d) for d, g in cert.groupby("design")]
        if calib:
            pd.concat(calib).to_csv(tables / "calibration_by_design.csv", index=False)
            written.append(tables / "calibration_by_design.csv")
    return written


def analyze(profile: str = "confirmatory") -> dict:
    from kvcert.analysis.claims import load_predictions
    from kvcert.prereg import verify

    prof = PROFILES[profile]
    out = Path(prof["out"])
    predictions = load_predictions(ROOT / "preregistration" / "predictions.yaml")
    cache: dict = {}
    records = {}
    for cid, name in CLAIMS.items():
        if cid != "T1":
            cfg = compose_claim(name, prof["overrides"])
            records[cid] = _load_records(Path(cfg.results_dir) / result_name(cfg), cache)
    t1_path = out / "tables" / "t1.json"
    t1 = json.loads(t1_path.read_text()) if t1_path.exists() else None
    runs = sorted({str(p.relative_to(ROOT)) if p.is_absolute() else str(p) for p in cache})
    return analyze_records(records, t1, predictions, out, verify(ROOT), profile=profile, runs=runs)


def analyze_records(records: dict[str, tuple[pd.DataFrame, pd.DataFrame | None]], t1: dict | None,
                    predictions: dict[str, dict], out: Path, lock_status: dict, *, profile: str,
                    runs: list[str]) -> dict:
    """Claims, tables, figures and the scorecard from records already loaded (claim id -> (examples, steps)),
    the T1 result and the lock status: everything `analyze` writes, with no config or file lookup."""
    from kvcert.analysis.claims import evaluate_claim, evaluate_t1
    from kvcert.analysis.figures import make_figures
    from kvcert.analysis.scorecard import build_scorecard, jsonable, write_scorecard

    out = Path(out)
    results: dict[str, dict] = {}
    main_records = None
    for cid in CLAIMS:
        spec = predictions[cid]
        if cid == "T1":
            if t1 is not None:
                results[cid] = evaluate_t1(t1, spec)
            continue
        examples, steps = records[cid]
        main_records = main_records or (examples, steps)
        started = time.perf_counter()
        results[cid] = evaluate_claim(cid, examples, steps if cid == "C1" else None, spec)
        r = results[cid]
        print(f"[kvcert] {cid}: {r['verdict']:12s} observed {r['observed']} CI {r['ci']} "
              f"(paper: {r['paper_verdict']}) [{time.perf_counter() - started:.1f}s]")
    figures = make_figures(results, main_records[0] if main_records else None, t1, out / "figures")
    if main_records:
        write_tables(*main_records, out, n_boot=500)
    for cid, r in results.items():
        (out / "tables").mkdir(parents=True, exist_ok=True)
        (out / "tables" / f"claim_{cid.lower()}.json").write_text(json.dumps(jsonable(r), indent=2))
    card = build_scorecard([results[c] for c in CLAIMS if c in results], lock_status)
    card["profile"] = profile
    card["runs"] = runs
    paths = write_scorecard(card, out, [Path(f) for f in figures])
    print(f"[kvcert] scorecard: {paths['md']}")
    return card


# --------------------------------------------------------------------------------------------------------- pilot
def pilot() -> None:
    """The pilot cell (disjoint seeds, every candidate design setting as a variant); writes results/pilot/summary."""
    cfg = compose_claim("pilot")
    run_dir = run_cell(cfg)
    out = ROOT / "results" / "pilot"
    ex = pd.read_parquet(run_dir / "examples.parquet")
    steps = pd.read_parquet(run_dir / "steps.parquet")
    table = _pilot_summary(ex, steps)
    table.to_csv(out / "summary.csv", index=False)
    text = table.to_markdown(index=False, floatfmt=".3f") if _has_tabulate() else table.to_string(index=False)
    (out / "summary.md").write_text(text + "\n")
    print(table.to_string(index=False))


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def _pilot_summary(ex: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    cert = steps[np.isfinite(steps.variance)]
    cov = (cert.error <= cert.radius95).groupby(cert.variant).mean().rename("coverage")
    g = ex.groupby(["variant", "scorer", "design", "budget", "tail_fraction", "floor"]).agg(
        accuracy=("correct", "mean"), full_accuracy=("full_correct", "mean"), cert_score=("cert_score", "mean"),
        rel_error=("rel_error_mean", "mean"), n=("correct", "size")).reset_index()
    return g.join(cov, on="variant")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.claims", description=__doc__.splitlines()[0])
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
