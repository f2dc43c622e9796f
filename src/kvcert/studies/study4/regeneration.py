"""Study 4's regeneration contract: regenerated records against the published ones, and the tolerances that judge
them (preregistration/study4/DEVIATIONS.md, stop 38).

A regenerated row is compared with its published row (matched by example and budget): the share of identical
answers (compressed and full cache) must reach IDENTICAL_SHARE, and on identical answers each signal must move less
than its tolerance. The locked tolerances (`LOCKED_TOLERANCE`) were set by hand; `derive_tolerances` measures float
noise as studies 1-3 do (preregistration/regeneration_tolerances.json): each model's first n examples regenerated on
one machine, independent of the published records, under the locked settings (1 thread, the compiled kernel) and
under two other float roundings (2 threads; the decode on torch ops instead of the kernel), and

    derived = K * sqrt(N / n) * max over the two of |change against the locked settings' replicate|,
    K = 3, N = the model's examples

(sqrt(N / n): the largest change over N examples rather than n). A check uses, per signal, the larger of the locked
and the derived tolerance, and reports the locked one's result beside it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from kvcert.studies.study4.common import MODELS, PREREG, RESULTS, complete, examples_for, planned_examples

LOCKED_TOLERANCE = {"certificate": ("rel", 1e-3), "logprob": ("abs", 1e-3), "probe_error": ("rel", 1e-3)}
IDENTICAL_SHARE = 0.95  # answers (compressed and full) identical in at least this share of regenerated rows
MULTIPLE = 3.0
TOLERANCES = "regeneration_tolerances.json"  # in preregistration/study4/, written by `study4 derive`


def _changes(a, b, kinds=LOCKED_TOLERANCE) -> tuple:
    """(matched rows, identical-answer mask, {signal: largest change on identical answers})."""
    both = a.merge(b, on=["example_id", "budget"], suffixes=("_published", "_regenerated"))
    same = (both["answer_published"] == both["answer_regenerated"]) & (
        both["full_answer_published"] == both["full_answer_regenerated"]
    )
    worst = {}
    for name, (kind, _) in kinds.items():
        x, y = both.loc[same, f"{name}_published"], both.loc[same, f"{name}_regenerated"]
        diff = (x - y).abs() / (x.abs().clip(lower=1e-12) if kind == "rel" else 1.0)
        worst[name] = float(diff.max()) if diff.notna().any() else 0.0
    return both, same, worst


def tolerances(tag: str, root: Path = Path(".")) -> dict[str, float]:
    """Per signal, the tolerance a check uses: the larger of the locked and the derived one (locked alone when
    `study4 derive` has not been run)."""
    out = {name: tol for name, (_, tol) in LOCKED_TOLERANCE.items()}
    path = root / PREREG / TOLERANCES
    if path.is_file():
        derived = json.loads(path.read_text())["models"].get(tag, {}).get("derived", {})
        out = {name: max(tol, float(derived.get(name, 0.0))) for name, tol in out.items()}
    return out


def compare_regenerated(records, new, used: dict[str, float] | None = None) -> tuple[bool, list[dict]]:
    """Published vs regenerated rows: identical answers, then each signal against the locked tolerance and against
    `used` (default: the locked ones). Passes by `used`."""
    used = used or {name: tol for name, (_, tol) in LOCKED_TOLERANCE.items()}
    both, same, worst = _changes(records, new)
    ok = bool(same.mean() >= IDENTICAL_SHARE) if len(both) else False
    verdict = "pass" if ok else "FAIL"
    rows = [dict(item="identical answers", value=f"{int(same.sum())} / {len(both)}",
                 locked_tolerance=f">= {IDENTICAL_SHARE:.0%}", locked_result=verdict,
                 tolerance=f">= {IDENTICAL_SHARE:.0%}", result=verdict)]  # fmt: skip
    passed = ok
    for name, (kind, locked) in LOCKED_TOLERANCE.items():
        nan_only = bool(both.loc[same, f"{name}_published"].isna().all()) if same.any() else True
        good = nan_only or worst[name] <= used[name]
        passed &= good
        rows.append(dict(item=f"{name} ({kind} difference, identical answers)", value=f"{worst[name]:.2e}",
                         locked_tolerance=f"<= {locked:g}",
                         locked_result="pass" if nan_only or worst[name] <= locked else "FAIL",
                         tolerance=f"<= {used[name]:.3g}", result="pass" if good else "FAIL"))  # fmt: skip
    return passed, rows


def _check_report(tag: str, what: str, passed: bool, rows: list[dict], root: Path = Path(".")) -> str:
    import pandas as pd

    from kvcert.analysis.tables import markdown_table

    source = (f"the larger of the locked and the derived tolerance ({PREREG / TOLERANCES})"
              if (root / PREREG / TOLERANCES).is_file() else "the locked tolerances")  # fmt: skip
    return "\n\n".join([
        f"# Study 4 regeneration check: {MODELS[tag]}",
        f"{what}: **{'PASS' if passed else 'FAIL'}** (tolerance: {source}; the locked tolerance's result beside it)",
        markdown_table(pd.DataFrame(rows)),
    ]) + "\n"  # fmt: skip


def _regenerate(tag: str, n: int, root: Path, threads: int, torch_ops: bool = False):
    """The first n published examples (by id) of one model regenerated: (published records, regenerated rows, n);
    torch_ops: the decode on torch ops, as decode.backend=torch (the collector's options take the default, auto)."""
    from unittest import mock

    import pandas as pd
    import torch

    from kvcert.hf import kernel, load_model
    from kvcert.studies.study4.collect import example_rows, load_answers

    records = load_answers(root / RESULTS / tag / "answers.jsonl")
    design = yaml.safe_load((root / PREREG / "design.yaml").read_text())
    torch.set_num_threads(threads)
    model, tokenizer = load_model(MODELS[tag])
    by_id = {e.id: e for e in examples_for(design, tag, tokenizer)}
    ids = sorted(set(records["example_id"]) & set(by_id))[:n]
    unavailable = mock.patch.object(kernel, "available", lambda: "study4 derive: the torch-ops replicate")
    with unavailable if torch_ops else mock.patch.object(kernel, "available", kernel.available):
        rows = [r for i in ids for r in example_rows(model, tokenizer, by_id[i], design["budgets"],
                                                     model_name=MODELS[tag])]  # fmt: skip
    return records, pd.DataFrame(rows), len(ids)


def regeneration_check(tag: str, n: int, root: Path = Path("."), threads: int = 1) -> tuple[bool, str]:
    """Regenerate the first n recorded examples (by id) of one model and compare them with the records. Returns
    (passed, a Markdown report)."""
    records, new, count = _regenerate(tag, n, root, threads)
    passed, rows = compare_regenerated(records, new, tolerances(tag, root))
    return passed, _check_report(tag, f"{count} examples (the first by id)", passed, rows, root)


def full_regeneration_check(tag: str, root: Path = Path(".")) -> tuple[bool, str]:
    """make reproduce's comparison: the full regeneration (`run --regenerate`) against the published records, by
    `compare_regenerated`, and every claim decided again on the regenerated records with its verdict compared."""
    from kvcert.studies.study4.claims import evaluate_claims
    from kvcert.studies.study4.collect import load_answers
    from kvcert.studies.study4.common import REGENERATED

    path = root / RESULTS / tag / REGENERATED / "answers.jsonl"
    if not complete(tag, root) or not path.is_file():
        raise SystemExit(
            f"study4 {tag}: no complete regeneration at {path}; run `study4 run --model {tag} --regenerate`"
        )
    records, new = load_answers(root / RESULTS / tag / "answers.jsonl"), load_answers(path)
    missing = set(records["example_id"]) - set(new["example_id"])
    if missing:
        raise SystemExit(f"study4 {tag}: the regeneration lacks {len(missing)} examples; rerun it (it resumes)")
    passed, rows = compare_regenerated(records, new, tolerances(tag, root))
    predictions = yaml.safe_load((root / PREREG / f"predictions_{tag}.yaml").read_text())
    published, again = evaluate_claims(records, predictions), evaluate_claims(new, predictions)
    for cid, claim in published.items():
        same = claim["verdict"] == again[cid]["verdict"]
        passed &= same
        result = "pass" if same else "FAIL"
        rows.append(dict(item=f"{cid} verdict", value=f"{claim['verdict']} / {again[cid]['verdict']}",
                         locked_tolerance="identical", locked_result=result, tolerance="identical",
                         result=result))  # fmt: skip
    n = int(new["example_id"].nunique())
    return passed, _check_report(tag, f"all {n} examples regenerated", passed, rows, root)


def derive_tolerances(n: int = 5, root: Path = Path(".")) -> dict:
    """Each model's first n examples under the locked settings and two other float roundings on this machine; the
    derived tolerance per signal."""
    from kvcert.records import cpu_model

    design = yaml.safe_load((root / PREREG / "design.yaml").read_text())
    models = {}
    for tag in MODELS:
        if not (root / RESULTS / tag / "answers.jsonl").is_file():
            continue
        _, locked, count = _regenerate(tag, n, root, threads=1)
        replicates = {"threads2": _regenerate(tag, n, root, threads=2)[1],
                      "torch_ops": _regenerate(tag, n, root, threads=1, torch_ops=True)[1]}  # fmt: skip
        changes, identical = {}, {}
        for name, rows in replicates.items():
            both, same, changes[name] = _changes(locked, rows)
            identical[name] = f"{int(same.sum())} / {len(both)}"
        worst = {k: max(c[k] for c in changes.values()) for k in LOCKED_TOLERANCE}
        big_n = planned_examples(design, tag)
        scale = MULTIPLE * math.sqrt(big_n / count)
        models[tag] = dict(n_sample=count, n_examples=big_n, identical=identical, max_change=changes,
                           derived={k: scale * v for k, v in worst.items()})  # fmt: skip
    return dict(
        rule="tolerance = max(locked, K * sqrt(N / n) * max |change against the locked settings| over the replicates "
        "threads2 and torch_ops); K = 3 (module docstring)",
        multiple=MULTIPLE,
        cpu=cpu_model(),
        locked={k: dict(kind=kind, tolerance=tol) for k, (kind, tol) in LOCKED_TOLERANCE.items()},
        models=models,
    )
