"""The regeneration tolerances (preregistration/regeneration_tolerances.json): `derive` regenerates a sample of each
study's published examples under several float roundings (the locked settings, the other thread count, the other
decode path), measures how far each replicate moves every claim estimate and how many answers or C1 cells flip, and
writes tolerance = K * max(sqrt(N / n) * max_r |delta_r|, sqrt(N_rows * p_flip) * q) per claim with the numbers it
comes from (the rule and its terms: kvcert.studies.regenerate's docstring); a derived study replaces its own entry
only. `load_tolerances` reads the file the contract judges by."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvcert.analysis import accuracy
from kvcert.analysis.claims import evaluate_claim, registry
from kvcert.records import cpu_model
from kvcert.studies.regeneration_compare import (
    ESTIMATES,
    MIN_IDENTICAL_ANSWERS,
    _num,
    _published,
    _rounded,
    answers_identical,
    cells_flipped,
    claim_estimates,
    regenerate_examples,
    sample_ids,
    splice,
    study_dir,
)

ROOT = Path(__file__).resolve().parents[3]


TOLERANCES = ROOT / "preregistration" / "regeneration_tolerances.json"


MULTIPLE = 3.0  # K: tolerances are K times the projected float noise


def load_tolerances(path: Path = TOLERANCES) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"no regeneration tolerances at {path}; derive them with `python -m kvcert.studies.regenerate derive`"
        )
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------------ the derivation
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
