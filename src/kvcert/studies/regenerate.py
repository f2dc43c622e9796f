"""The regeneration contract: regenerated records are judged against a study's published records by declared
tolerances, not by bytes (float rounding changes with the CPU, the thread count and the library versions).

    python -m kvcert.studies.regenerate check --study all -n 10   # a sample: `make regenerate-check`, minutes
    python -m kvcert.studies.regenerate full --study all           # `make reproduce`: regenerated vs published
    python -m kvcert.studies.regenerate derive --study study3 -n 10  # measure float noise -> the tolerance file

`--study` names one study (study1, study2, study3_smollm2, study3_gemma3), `study3` (both study-3 models) or `all`.

The contract (docs/reproduction.md), per study:
- the verdict of every claim is identical;
- every claim estimate (observed value and both CI bounds) lies within its declared tolerance of the published one;
- at least 99% of the (example, variant) answers are identical.

`check` regenerates n examples (evenly spaced over the published examples sorted by id, so every task and length
is drawn), splices them into the published records in place of their published rows and evaluates every claim with
the locked analysis. `full` compares a complete regenerated publication (`make reproduce` writes it to
results/<study>/regenerated/) with the published one. Both write results/<study>/regeneration{_check}.{md,json} and
fail on a changed verdict, an estimate outside its tolerance or too few identical answers.

`derive` regenerates the same sample under several float roundings (the study's locked settings, the other thread
count, the other decode path), measures how far each replicate moves every claim estimate and how many answers
flip, and writes the tolerances (preregistration/regeneration_tolerances.json) with the numbers they come from; the
studies it derives replace their own entries only, every other study's entry stays as it was:

    tolerance = K * max( sqrt(N / n) * max_r |delta_r| ,  sqrt(N_rows * p_flip) * q )

delta_r is the claim estimate's change when replicate r's n examples replace the published ones; sqrt(N / n)
projects it to all N examples under independent per-example noise; p_flip is the upper 95% bound of the measured
rate of flipped answers (a flipped cell for C1), N_rows the rows (cells) the claim reads and q the largest change
one flip makes (measured by flipping single published answers); K = 3.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis import accuracy
from kvcert.analysis.claims import evaluate_claim, registry
from kvcert.records import cpu_model
from kvcert.studies import cells as cell_table
from kvcert.studies import published

ROOT = Path(__file__).resolve().parents[3]
TOLERANCES = ROOT / "preregistration" / "regeneration_tolerances.json"
MIN_IDENTICAL_ANSWERS = 0.99
MULTIPLE = 3.0  # K: tolerances are K times the projected float noise
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
    from kvcert.reproduce import _c1_entry, compose_claim, settings

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
    from kvcert.reproduce import _is_t1, settings

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
def load_tolerances(path: Path = TOLERANCES) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"no regeneration tolerances at {path}; derive them with `python -m kvcert.studies.regenerate derive`"
        )
    return json.loads(path.read_text())


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
        "| claim | estimate | published | regenerated | difference | tolerance | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["claims"]:
        cells = [r["claim"], r["estimate"], r["published"], r["regenerated"], r["difference"], r["tolerance"]]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + f" | {_fmt(r['pass'])} |")
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


# --------------------------------------------------------------------------------------------- commands
def _published(study: str) -> dict:
    from kvcert.reproduce import settings

    return published.load_published(settings(study)["published"])


def study_dir(study: str) -> Path:
    """results/<study>/: the study's scorecard folder, where its regeneration reports and scratch live."""
    from kvcert.reproduce import settings

    return Path(settings(study)["scorecard"])


def check(study: str, n: int, *, fresh: bool = True, out_dir: Path | None = None) -> dict:
    """`make regenerate-check`: n examples regenerated, spliced into the published records, judged; the report goes
    to <out_dir>/regeneration_check.{md,json} (default results/<study>/), the scratch to <out_dir>/regeneration/."""
    out = Path(out_dir) if out_dir is not None else study_dir(study)
    scratch = out / "regeneration" / "check"
    if fresh and scratch.exists():
        shutil.rmtree(scratch)  # a check always regenerates with this checkout's code
    pub = _published(study)
    ids = sample_ids(pub["examples"], n)
    tolerances = load_tolerances()  # before any work: a missing file fails at once
    regen = regenerate_examples(study, ids, scratch)
    reference = claim_estimates(study, pub)
    spliced = claim_estimates(study, splice(pub, regen))
    answers = answers_identical(pub["examples"], regen["examples"])
    result = compare(study, reference, spliced, answers, tolerances) | {"n_examples": len(ids), "ids": ids}
    paths = write_report(result, out / "regeneration_check", title=f"Regeneration check ({len(ids)} examples)")
    print(paths["md"].read_text())
    return result


def full(study: str) -> dict:
    """`make reproduce`: the regenerated publication (results/<study>/regenerated/) judged against the published."""
    regen = published.load_published(study_dir(study) / "regenerated")
    pub = _published(study)
    reference = claim_estimates(study, pub)
    new = claim_estimates(study, regen)
    answers = answers_identical(pub["examples"], regen["examples"])
    n = int(regen["examples"]["example_id"].nunique())
    result = compare(study, reference, new, answers, load_tolerances()) | {"n_examples": n}
    paths = write_report(result, study_dir(study) / "regeneration", title="Regeneration of the published records")
    print(paths["md"].read_text())
    return result


def _other_path(study: str) -> list[str]:
    """The other backend of the decode engine: the float rounding of another implementation of the same math (the
    tolerances file records the replicates of its derivation as they were run)."""
    return ["decode.backend=torch"]


def replicates(study: str) -> dict[str, list[str]]:
    from kvcert.reproduce import settings

    threads = int(settings(study)["threads"])
    return {
        "locked": [],
        f"threads{3 - threads}": [f"threads={3 - threads}"],
        "other_path": _other_path(study),
    }


def _one_flip_quantum(study: str, pub: dict, cid: str, rng: np.random.Generator, tries: int = 5) -> float:
    """The largest change of a claim's estimate when one published answer it reads flips (correct <-> wrong): the
    claim's selected rows (its `rows` in predictions.yaml), a few drawn at random, one at a time."""
    from kvcert.reproduce import settings

    spec = registry(settings(study)["predictions"], settings(study)["claims"])[cid].spec
    ex = pub["examples"]
    selected = accuracy.select_rows(ex, dict(spec["rows"])) if spec.get("rows") else ex
    candidates = ex.index.get_indexer(selected.index[selected["design"].astype(str) != "full"])
    base = claim_estimates_one(study, pub, cid)
    worst = 0.0
    for index in rng.choice(candidates, size=min(tries, len(candidates)), replace=False):
        flipped = ex.copy()
        flipped.loc[flipped.index[index], "correct"] = not bool(flipped["correct"].iloc[index])
        new = claim_estimates_one(study, pub | {"examples": flipped}, cid)
        for est in ESTIMATES:
            if base[est] is not None and new[est] is not None:
                worst = max(worst, abs(new[est] - base[est]))
    return worst


def claim_estimates_one(study: str, records: dict, cid: str) -> dict:
    from kvcert.reproduce import settings

    st = settings(study)
    entry = registry(st["predictions"], st["claims"])[cid]
    r = evaluate_claim(cid, records["examples"], None, entry.spec)
    return {"observed": _num(r.observed), "ci_lo": _num(r.ci[0]), "ci_hi": _num(r.ci[1])}


def _upper95(k: int, n: int) -> float:
    """Clopper-Pearson upper 95% bound of a binomial rate (k of n)."""
    from scipy.stats import beta

    return 1.0 if n == 0 else float(beta.ppf(0.95, k + 1, n - k)) if k < n else 1.0


def derive(studies: Sequence[str], n: int) -> dict:
    """Regenerate the sample under each float rounding, measure, and write the tolerance file: the derived studies'
    entries are replaced (each with the CPU it was derived on), every other study's entry is kept as it was."""
    entries = {}
    for study in studies:
        rng = np.random.default_rng(0)  # per study: a study's tolerances do not depend on which others are derived
        pub = _published(study)
        ids = sample_ids(pub["examples"], n)
        n_all = int(pub["examples"]["example_id"].nunique())
        reference = claim_estimates(study, pub)
        measured, answers, flips = {}, {}, {}
        for name, overrides in replicates(study).items():
            scratch = study_dir(study) / "regeneration" / name
            regen = regenerate_examples(study, ids, scratch, overrides)
            new = claim_estimates(study, splice(pub, regen))
            measured[name] = {
                cid: {est: _delta(reference[cid][est], new[cid][est]) for est in ESTIMATES} for cid in reference
            }
            answers[name] = answers_identical(pub["examples"], regen["examples"])
            flips[name] = cells_flipped(pub["cells"][pub["cells"]["example_id"].astype(str).isin(ids)], regen["cells"])
        rows = sum(a["rows"] for a in answers.values())
        flipped = sum(a["rows"] - a["identical"] for a in answers.values())
        cells_n = sum(f["cells"] for f in flips.values())
        cells_f = sum(f["flipped"] for f in flips.values())
        p_answer, p_cell = _upper95(flipped, rows), _upper95(cells_f, cells_n)
        claims = {}
        for cid, ref in reference.items():
            spread = max(abs(d) for m in measured.values() for d in m[cid].values() if d is not None)
            if ref["unit"] == "cells":
                p, q = p_cell, 1.0 / max(ref["n_rows"], 1)  # one flipped cell moves a coverage by 1 / cells
            else:
                p, q = p_answer, _one_flip_quantum(study, pub, cid, rng)
            projected = math.sqrt(n_all / len(ids)) * spread
            floor = math.sqrt(ref["n_rows"] * p) * q
            claims[cid] = {
                "tolerance": MULTIPLE * max(projected, floor),
                "max_abs_delta_sample": spread,
                "projected_sqrt_N_over_n": projected,
                "flip_floor": floor,
                "p_flip_upper95": p,
                "one_flip_change": q,
                "n_rows": ref["n_rows"],
                "unit": ref["unit"],
            }
        entries[study] = {
            "cpu": cpu_model(),
            "n_sample": len(ids),
            "n_examples": n_all,
            "ids": ids,
            "replicates": {k: " ".join(v) or "(the locked settings)" for k, v in replicates(study).items()},
            "answers": answers,
            "cells_flipped": flips,
            "deltas": measured,
            "claims": claims,
        }
    return write_tolerances(entries)


def write_tolerances(entries: dict[str, dict], path: Path = TOLERANCES) -> dict:
    """Write the derived studies' entries into the tolerance file: each replaces its own study's entry, every
    other study's entry is kept as it was (a derivation of study 3 leaves studies 1 and 2 alone)."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    document = {
        "rule": "tolerance = K * max(sqrt(N/n) * max_r |delta_r|, sqrt(N_rows * p_flip) * q); K = 3 (module docstring)",
        "multiple": MULTIPLE,
        "min_identical_answers": MIN_IDENTICAL_ANSWERS,
        "cpu": old.get("cpu", cpu_model()),  # where the first studies were derived; later ones name their own CPU
        "studies": old.get("studies", {}) | entries,
    }
    path.write_text(json.dumps(_rounded(document), indent=2) + "\n")
    print(f"[kvcert] tolerances of {', '.join(entries)} -> {path}")
    return document


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def study_groups() -> dict[str, list[str]]:
    """The names `--study` accepts beside each study of kvcert.reproduce.STUDIES: `all` (every study, in its order)
    and `study3` (both study-3 models)."""
    from kvcert.reproduce import STUDIES

    return {"all": list(STUDIES), "study3": [s for s in STUDIES if s.startswith("study3_")]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.studies.regenerate", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["check", "full", "derive"])
    groups = study_groups()
    parser.add_argument("--study", default="all", choices=[*groups["all"], *groups])
    parser.add_argument("-n", type=int, default=10, help="examples per study (check, derive); default 10")
    parser.add_argument("--resume", action="store_true", help="check: reuse examples already regenerated")
    args = parser.parse_args(argv)
    studies = groups.get(args.study, [args.study])
    if args.n < 1:
        print("error: -n must be at least 1 (examples per study)", file=sys.stderr)
        return 2
    try:
        if args.command == "derive":
            derive(studies, args.n)
            return 0
        results = [check(s, args.n, fresh=not args.resume) if args.command == "check" else full(s) for s in studies]
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = [r["study"] for r in results if not r["ok"]]
    if failed:
        print(f"error: regeneration outside the contract for {', '.join(failed)} (tables above)", file=sys.stderr)
        return 1
    print(f"[kvcert] regeneration within the contract: {', '.join(studies)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
