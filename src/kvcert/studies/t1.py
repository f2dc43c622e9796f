"""Study 2's T1: study 1's evaluation (kvcert.analysis.claims.evaluate_t1, locked) plus the check study 1 left out:
the deterministic design's retained data stay bit-identical at every lambda (the premise of non-identifiability)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvcert.analysis.claims import ClaimResult, _agrees, evaluate_t1


def evaluate_t1_study2(t1_result: Mapping[str, list], spec: Mapping[str, object]) -> ClaimResult:
    """evaluate_t1, with `retained_identical` (every lambda) as one more check: a supported T1 whose retained data
    changed becomes refuted, since the demonstration's premise failed; a missing flag makes it inconclusive."""
    base = evaluate_t1(t1_result, spec)
    flags = t1_result.get("retained_identical")
    checks = dict(base.details.get("checks", {}))
    if flags is None or len(flags) == 0:
        checks["retained_identical"] = None
        verdict = "inconclusive" if base.verdict == "supported" else base.verdict
    else:
        checks["retained_identical"] = bool(all(bool(f) for f in flags))
        verdict = base.verdict if checks["retained_identical"] else "refuted"
    return dataclasses.replace(
        base,
        verdict=verdict,
        agrees_with_paper=_agrees(verdict, base.paper_verdict),
        details={**base.details, "checks": checks},
    )
