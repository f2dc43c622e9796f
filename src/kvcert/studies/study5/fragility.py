"""How fragile study 5's within-cell verdicts are (exploratory, no verdict of its own).

The pre-registered interval of a within-cell claim (P1, P2) fixes each signal's escalations on the whole
confirmatory split and resamples examples (2000 resamples, seed 20260101). Two things it leaves open move verdicts
that sit at an edge:

- the bootstrap's own randomness: the same interval under seeds 1-9 (`by_seed`);
- the selection: each resample redoing the within-cell selection (the top round(20% n_cell) of each cell among the
  resampled examples, ties by example id) instead of keeping the full sample's (`reselected`). The PLAN leaves it
  open; the claims keep the pre-registered interval.

`lines` writes the report's paragraph under a model's claims. Pure numpy over the analysis' frames.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from kvcert.analysis.bootstrap import bootstrap_weights, paired_difference, weighted_mean
from kvcert.analysis.tables import markdown_table
from kvcert.studies.study4.claims import verdict
from kvcert.studies.study5.signals import cells

SEEDS = tuple(range(1, 10))
CLAIMS = ("P1", "P2")  # the within-cell claims


def _result(estimate: float, lo: float, hi: float, spec: Mapping) -> dict:
    out = dict(estimate=float(estimate), lo=float(lo), hi=float(hi))
    return out | dict(verdict=verdict(spec["rule"], out, float(spec.get("margin", 0.0))))


def by_seed(s, spec: Mapping, n_boot: int, seeds=SEEDS) -> list[dict]:
    """The claim's pre-registered interval (escalations fixed) under each bootstrap seed: seed, estimate, lo, hi,
    verdict. `s`: the claim's `analysis.Study5`."""
    ca = s.within(spec["a"])["correct"].to_numpy(float)
    cb = s.within(spec["b"])["correct"].to_numpy(float)
    out = []
    for seed in seeds:
        ci = paired_difference(weighted_mean(ca), weighted_mean(cb), s.conf["example_id"], n_boot, seed,
                               diff=weighted_mean(ca - cb))["diff"].scaled(100)  # fmt: skip
        out.append(dict(seed=seed) | _result(ci.estimate, ci.lo, ci.hi, spec))
    return out


def wins(s, spec: Mapping) -> tuple[int, int]:
    """Examples where a's escalation is right and b's wrong, and the reverse (the pairs the difference rests on)."""
    ca = s.within(spec["a"])["correct"].to_numpy(float)
    cb = s.within(spec["b"])["correct"].to_numpy(float)
    return int(((ca == 1) & (cb == 0)).sum()), int(((ca == 0) & (cb == 1)).sum())


def _gains(frame: pd.DataFrame, scores: np.ndarray, weights: np.ndarray, rate: float) -> np.ndarray:
    """Per resample (a row of `weights`: copies of each row of `frame`), the accuracy gained by escalating the top
    round(rate n_cell) copies of each cell (by score, then example id: `within_cell_escalated`'s order), summed."""
    cell = pd.factorize(pd.Series(cells(frame)))[0]
    n_cells = int(cell.max()) + 1
    ids = pd.factorize(frame["example_id"], sort=True)[0]
    s = np.where(np.isfinite(scores), scores, -np.inf)
    order = np.lexsort((ids, -s, cell))  # cell by cell, each by score descending, then id
    gain = (frame["full_correct"].to_numpy(float) - frame["correct"].to_numpy(float))[order]
    w, c = weights[:, order], cell[order]
    per_cell = np.zeros((len(w), n_cells))
    np.add.at(per_cell.T, c, w.T)
    k = np.round(rate * per_cell)[:, c]  # Python's round(rate * n): half to even, as numpy's
    start = np.concatenate([[0], np.flatnonzero(np.diff(c)) + 1])
    cum = np.cumsum(w, axis=1)
    before = (cum - w) - np.repeat((cum - w)[:, start], np.diff(np.append(start, len(c))), axis=1)
    taken = np.clip(k - before, 0, w)
    return taken @ gain


def reselected(s, spec: Mapping, n_boot: int, seed: int, rate: float) -> dict:
    """The claim's difference (points) when each resample redoes the within-cell selection: estimate (the full
    sample's, equal to the claim's), lo, hi, verdict."""
    frame = s.conf
    ones = np.ones((1, len(frame)))
    n = len(frame)

    def diff(weights: np.ndarray) -> np.ndarray:
        a = _gains(frame, frame[f"score_{spec['a']}"].to_numpy(np.float64), weights, rate)
        b = _gains(frame, frame[f"score_{spec['b']}"].to_numpy(np.float64), weights, rate)
        return 100 * (a - b) / n

    codes = pd.factorize(frame["example_id"], sort=True)[0]
    samples = diff(bootstrap_weights(int(codes.max()) + 1, n_boot, seed)[:, codes])
    lo, hi = np.quantile(samples, [0.025, 0.975])
    return _result(diff(ones)[0], lo, hi, spec)


def lines(model: str, studies: Mapping, specs: Mapping, claims: Mapping, n_boot: int, seed: int, rate: float) -> list:
    """The report's paragraph: per within-cell claim, the published interval, the interval under seeds 1-9 and with
    the selection redone, and whether the verdict holds under each. studies: claim id -> its `analysis.Study5`."""
    out = ["### how fragile the within-cell verdicts are (exploratory; no verdict changes)", ""]
    rows = []
    for cid in CLAIMS:
        if cid not in claims or cid not in studies:
            continue
        spec, c, s = specs[cid], claims[cid], studies[cid]
        seeds = by_seed(s, spec, n_boot)
        again = reselected(s, spec, n_boot, seed, rate)
        won, lost = wins(s, spec)
        counts = pd.Series([r["verdict"] for r in seeds]).value_counts()
        held = int(counts.get(c["verdict"], 0))
        rows.append(dict(claim=cid, published=f"{c['verdict']} {c['estimate']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]",
                         seeds_1_9_lo=f"{min(r['lo'] for r in seeds):.3f} to {max(r['lo'] for r in seeds):.3f}",
                         seeds_1_9_verdicts=", ".join(f"{k} {v}" for k, v in counts.items()),
                         selection_redone=f"{again['verdict']} [{again['lo']:.3f}, {again['hi']:.3f}]",
                         a_wins_b_wins=f"{won} / {lost}"))  # fmt: skip
        notes = []
        if held < len(seeds):
            notes.append(f"{len(seeds) - held} of {len(seeds)} other bootstrap seeds give another verdict")
        if again["verdict"] != c["verdict"]:
            notes.append(f"redoing the within-cell selection in each resample makes it {again['verdict']}")
        if notes:
            rest = f"it rests on {won} examples where {spec['a']} wins against {lost}"
            out.append(f"- **{model} {cid} is fragile** ({c['verdict']} as pre-registered, and stays so): "
                       + "; ".join([*notes, rest]) + ".")  # fmt: skip
    if rows:
        out += ["", markdown_table(pd.DataFrame(rows)), ""]
    return out
