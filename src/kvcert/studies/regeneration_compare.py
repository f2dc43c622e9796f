"""Regenerated vs published records (the contract of kvcert.studies.regenerate): the sample of published examples,
their regeneration with the study's locked settings, the splice of the regenerated rows into the published records,
every record claim's estimates by the locked analysis, the identical answers and flipped C1 cells, and the contract's
comparison table with its Markdown and JSON report."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis import accuracy
from kvcert.analysis.claims import evaluate_claim, registry
from kvcert.analysis.tables import markdown_table
from kvcert.records import cpu_model
from kvcert.studies import cells as cell_table
from kvcert.studies import published

MIN_IDENTICAL_ANSWERS = 0.99
ESTIMATES = ("observed", "ci_lo", "ci_hi")


# ------------------------------------------------------------------------------------------------ the sample
def sample_ids(examples: pd.DataFrame, n: int) -> list[str]:
    """n example ids evenly spaced over the published ids sorted (task, length, index order): every task and length
    is drawn when n covers them."""
    ids = sorted(examples["example_id"].astype(str).unique())
    if n >= len(ids):
        return ids
    picks = np.unique(np.round(np.linspace(0, len(ids) - 1, n)).astype(int))
    return [ids[i] for i in picks]


def _study_config(study: str, extra: Sequence[str] = ()):
    from kvcert.reproduce import compose_claim, settings
    from kvcert.studies.analyze import _c1_entry

    st = settings(study)
    c1 = _c1_entry(registry(st["predictions"], st["claims"]))
    return st, c1, compose_claim(st["prefix"] + c1.experiment, [*st["overrides"], *extra])


def regenerate_examples(
    study: str, ids: Sequence[str], scratch: Path, extra_overrides: Sequence[str] = (), *, log=print
) -> dict[str, pd.DataFrame]:
    """Regenerate the published examples `ids` with the study's locked settings (plus extra_overrides) and this
    checkout's code: their examples rows and their C1 cells and exceedances, as `publish` would write them.
    One file per example in `scratch` (resumable: an example already there is read back)."""
    import torch

    from kvcert.config import policies
    from kvcert.hf import generate_variants, load_model
    from kvcert.records import example_frame, step_frame
    from kvcert.run import decode_options, load_examples
    from kvcert.shards import atomic_parquet
    from kvcert.tasks import render

    st, c1, cfg = _study_config(study, extra_overrides)
    pub = published.load_published(st["published"])
    run = str(pub["examples"]["run"].iloc[0])  # the published run name: spliced rows join the published ones
    rows = dict(st.get("publish_rows") or c1.spec["rows"])  # the rows `publish` wrote (study 3 adds S6c's)
    multipliers = cell_table.read_multipliers(st["multipliers"]) if st.get("multipliers") else None
    floor = float(pub["meta"]["numerical_floor"])
    scratch.mkdir(parents=True, exist_ok=True)
    todo = [i for i in ids if not (scratch / f"{i}.examples.parquet").exists()]
    if todo:
        torch.set_num_threads(int(cfg.threads))
        model, tokenizer = load_model(
            cfg.model.name, cache_dir=cfg.model.cache_dir, dtype=getattr(torch, cfg.model.dtype), device=cfg.device
        )
        by_id = {ex.id: ex for ex in load_examples(cfg, tokenizer)}
        unknown = [i for i in todo if i not in by_id]
        if unknown:
            raise ValueError(f"{study}: the config does not generate examples {unknown[:3]}; is the checkout complete?")
        variants = policies(cfg)
        for k, example_id in enumerate(todo, 1):
            started = time.perf_counter()
            example = by_id[example_id]
            prompt = render(example, tokenizer, cfg.model.prompt_format)
            results = generate_variants(model, tokenizer, prompt, variants, decode_options(cfg, prompt.stop_strings))
            ex_df = example_frame(run, example, len(prompt.input_ids), results)
            steps = step_frame(run, example.id, results)
            cells, _ = cell_table.coverage_cells(
                ex_df, steps, rows=rows, multipliers=multipliers, numerical_floor=floor
            )
            exceed = published.exceedances(published.c1_cells(ex_df, steps, rows))
            atomic_parquet(cells.reset_index(drop=True), scratch / f"{example_id}.cells.parquet")
            atomic_parquet(exceed, scratch / f"{example_id}.exceedances.parquet")
            atomic_parquet(ex_df, scratch / f"{example_id}.examples.parquet")  # last: marks the example done
            log(f"[kvcert] {study}: regenerated {example_id} ({k}/{len(todo)}) in {time.perf_counter() - started:.0f}s")
    read = {
        part: pd.concat([pd.read_parquet(scratch / f"{i}.{part}.parquet") for i in ids], ignore_index=True)
        for part in ("examples", "cells", "exceedances")
    }
    return read


def splice(pub: dict, regen: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The published records with every regenerated example's rows in place of its published rows."""
    ids = set(regen["examples"]["example_id"].astype(str))
    out = {}
    for part in ("examples", "cells", "exceedances"):
        keep = pub[part][~pub[part]["example_id"].astype(str).isin(ids)]
        new = regen[part]
        merged = pd.concat([keep.astype({"example_id": str}), new.astype({"example_id": str})], ignore_index=True)
        for col in ("run", "example_id", "variant"):  # cells keep categorical keys, as published
            if col in merged and isinstance(pub[part][col].dtype, pd.CategoricalDtype):
                merged[col] = merged[col].astype(str).astype("category")
        out[part] = merged
    return out


# --------------------------------------------------------------------------------------------- the claims
def claim_estimates(study: str, records: dict[str, pd.DataFrame]) -> dict[str, dict]:
    """{claim id: verdict, observed, ci_lo, ci_hi, n_rows} by the locked analysis (T1 is not a record claim)."""
    from kvcert.reproduce import settings
    from kvcert.studies.analyze import _is_t1

    st = settings(study)
    claims = registry(st["predictions"], st["claims"])
    steps = published.synthetic_steps(records["cells"], records["exceedances"])
    out = {}
    for cid, entry in claims.items():
        if _is_t1(entry.spec):
            continue
        coverage = entry.spec["analysis"] == "coverage"
        r = evaluate_claim(cid, records["examples"], steps if coverage else None, entry.spec)
        rows = _c1_cells(records, entry.spec) if coverage else _claim_rows(records["examples"], entry.spec)
        out[cid] = {
            "verdict": r.verdict,
            "observed": _num(r.observed),
            "ci_lo": _num(r.ci[0]),
            "ci_hi": _num(r.ci[1]),
            "n_rows": rows,
            "unit": "cells" if coverage else "answers",
        }
    return out


def _num(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _c1_cells(records: dict[str, pd.DataFrame], spec: dict) -> int:
    """The C1 cells the coverage claim reads: the cells of its selected variants (a study may publish more rows,
    e.g. study 3's S6c rows)."""
    selected = accuracy.select_rows(records["examples"], dict(spec["rows"]))
    variants = set(selected["variant"].astype(str))
    cells = records["cells"]
    return int(cells.loc[cells["variant"].astype(str).isin(variants), "n_cells"].sum())


def _claim_rows(examples: pd.DataFrame, spec: dict) -> int:
    """The (example, variant) answers a claim reads: its selected rows when it names them, else every row."""
    if spec.get("rows"):
        return int(len(accuracy.select_rows(examples, dict(spec["rows"]))))
    return int(len(examples))


def answers_identical(pub_examples: pd.DataFrame, regen_examples: pd.DataFrame) -> dict:
    """The share of (example, variant) answers that are identical, and the largest change of each continuous
    column among the rows whose answers are identical (descriptive)."""
    keys = ["example_id", "variant"]
    merged = pub_examples.merge(regen_examples, on=keys, suffixes=("_pub", "_regen"), how="inner")
    if len(merged) != len(regen_examples):
        raise ValueError(
            f"{len(regen_examples) - len(merged)} regenerated (example, variant) rows have no published row; "
            "the study's grid changed"
        )
    same = (merged["answer_pub"].astype(str) == merged["answer_regen"].astype(str)).to_numpy()
    out = {"rows": int(len(merged)), "identical": int(same.sum()), "share": float(same.mean()) if len(merged) else 1.0}
    drift = {}
    for col in ("logprob_mean", "logprob_min", "cert_score", "rel_error_mean", "kept_tokens", "covered95"):
        a = merged.loc[same, f"{col}_pub"].to_numpy(np.float64)
        b = merged.loc[same, f"{col}_regen"].to_numpy(np.float64)
        ok = np.isfinite(a) & np.isfinite(b)
        drift[col] = float(np.max(np.abs(a[ok] - b[ok]))) if ok.any() else 0.0
    out["max_abs_change_where_identical"] = drift
    return out


def cells_flipped(pub_cells: pd.DataFrame, regen_cells: pd.DataFrame) -> dict:
    """C1 cells whose (regime, standardized-error bin, trust) class changed: half the L1 distance of the counts."""
    keys = [k for k in published.CELL_KEYS if k != "run"]
    a = pub_cells.astype({"example_id": str, "variant": str}).groupby(keys, observed=True)["n_cells"].sum()
    b = regen_cells.astype({"example_id": str, "variant": str}).groupby(keys, observed=True)["n_cells"].sum()
    both = pd.concat([a.rename("a"), b.rename("b")], axis=1).fillna(0)
    return {"cells": int(both["a"].sum()), "flipped": int(np.abs(both["a"] - both["b"]).sum() // 2)}


# -------------------------------------------------------------------------------------------- the verdict
def compare(study: str, reference: dict, regenerated: dict, answers: dict, tolerances: dict) -> dict:
    """The contract's table: per claim and estimate the published and regenerated value, the difference, the
    tolerance and pass/fail; the verdicts; the share of identical answers. `ok` is the overall result."""
    tol = tolerances["studies"][study]["claims"]
    rows, ok = [], True
    for cid, ref in reference.items():
        new = regenerated[cid]
        same_verdict = ref["verdict"] == new["verdict"]
        ok &= same_verdict
        rows.append({"claim": cid, "estimate": "verdict", "published": ref["verdict"], "regenerated": new["verdict"]})
        rows[-1].update({"difference": None, "tolerance": None, "pass": same_verdict})
        for est in ESTIMATES:
            a, b = ref[est], new[est]
            t = float(tol[cid]["tolerance"])
            diff = None if a is None or b is None else b - a
            passed = (a is None and b is None) or (diff is not None and abs(diff) <= t)
            ok &= passed
            rows.append(
                {"claim": cid, "estimate": est, "published": a, "regenerated": b, "difference": diff}
                | {"tolerance": t, "pass": passed}
            )
    answers_ok = answers["share"] >= MIN_IDENTICAL_ANSWERS
    return {
        "study": study,
        "ok": bool(ok and answers_ok),
        "claims": rows,
        "answers": answers | {"required_share": MIN_IDENTICAL_ANSWERS, "pass": bool(answers_ok)},
    }


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "pass" if x else "FAIL"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def report_markdown(result: dict, *, title: str, cpu: str) -> str:
    a = result["answers"]
    lines = [
        f"# {title}",
        "",
        f"Study: {result['study']}. Result: **{'PASS' if result['ok'] else 'FAIL'}**. CPU: {cpu}.",
        f"Examples regenerated: {result.get('n_examples', '-')}.",
        "",
        f"Identical answers: {a['identical']} of {a['rows']} (example, variant) rows = {a['share']:.4f} "
        f"(required >= {a['required_share']}): {_fmt(a['pass'])}.",
        "",
    ]
    keys = ["claim", "estimate", "published", "regenerated", "difference", "tolerance", "pass"]
    rows = [[_fmt(r[k]) for k in keys] for r in result["claims"]]
    lines.append(markdown_table(pd.DataFrame(rows, columns=[*keys[:-1], "result"]), parse_numbers=False))
    drift = a.get("max_abs_change_where_identical") or {}
    if drift:
        lines += ["", "Largest change where the answer is identical (descriptive):", ""]
        lines += [f"- `{k}`: {v:.3g}" for k, v in drift.items()]
    return "\n".join(lines) + "\n"


def _rounded(obj):
    if isinstance(obj, float):
        return float(f"{obj:.10g}") if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_rounded(v) for v in obj]
    return obj


def write_report(result: dict, out: Path, *, title: str) -> dict[str, Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    result = _rounded(result | {"cpu": cpu_model()})
    paths = {"json": out.with_suffix(".json"), "md": out.with_suffix(".md")}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["md"].write_text(report_markdown(result, title=title, cpu=result["cpu"]))
    return paths


# ------------------------------------------------------------------------------------------------ the study
def _published(study: str) -> dict:
    from kvcert.reproduce import settings

    return published.load_published(settings(study)["published"])


def study_dir(study: str) -> Path:
    """results/<study>/: the study's scorecard folder, where its regeneration reports and scratch live."""
    from kvcert.reproduce import settings

    return Path(settings(study)["scorecard"])
