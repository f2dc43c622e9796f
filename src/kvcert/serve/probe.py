"""The prefill probe of one prompt as `generate` reports it (`Generation.probe`), and the budget chosen from a
tolerance.

The probe (kvcert.core.probe) measures, while each layer still holds its full keys and values, the exact error of
the compressed attention for the observation window's queries (the question's tokens for question-aware scorers).
Per prompt it is reduced to

- `error`: the mean, over compressed layers, query heads and window queries, of ||o_hat - o|| / ||o||: the
  measured relative attention error of this cache on this prompt's question (exact, deterministic given the draw);
- `certificate`: the randomized design's certificate of the same queries, calibrated and reduced exactly as a
  token's certificate (kvcert.serve.certificate), NaN for a deterministic design;
- `risk`: the calibration's estimate of the probability that this cache turns a right answer wrong, from a
  logistic model of cache-induced failures on the probe error fitted by `kvcert calibrate` (None without one).

`generate(..., tolerance=t)` reads the prompt once for every budget of the ladder (a probe-only read: no cache is
built), takes the smallest budget whose probe `error` is at most t, and decodes only there; above every rung it
takes the full cache. t is therefore a relative attention error (0.1: the question's attention outputs are within
10% of the full cache's on average); `kvcert calibrate` reports which cache-induced failure rate each t gave on its
held-out examples (`Calibration.report["tolerance"]`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from kvcert.core.probe import ProbeResult
from kvcert.policy import Policy
from kvcert.serve.certificate import token_certificate

DEFAULT_LADDER = (0.125, 0.25, 0.5, 1.0)


@dataclass
class Probe:
    budget: float
    error: float  # mean relative attention error of the window's queries over compressed layers (see module doc)
    layers: list[float]  # per layer, the same mean (NaN on layers not compressed)
    certificate: float  # the window queries' certificate, reduced like a token's (NaN: deterministic design)
    calibrated: bool  # whether `certificate` carries a calibration's multipliers
    risk: float | None = None  # P(cache-induced failure | error), from the calibration's probe model


@dataclass
class BudgetChoice:
    tolerance: float
    ladder: list[float]
    errors: dict[str, float]  # budget -> probe error, for every rung below the full cache
    chosen: float
    extra_prefill_tokens: int  # the probe-only read of the prompt
    reason: str = ""


def layer_errors(results: list[ProbeResult | None]) -> list[float]:
    return [math.nan if r is None else float(r.relative_error.double().mean()) for r in results]


def probe_error(results: list[ProbeResult | None]) -> float:
    """The prompt's probe error: the mean of the compressed layers' mean relative errors (NaN when none is)."""
    values = [x for x in layer_errors(results) if math.isfinite(x)]
    return sum(values) / len(values) if values else math.nan


def summarize(
    results: list[ProbeResult | None], budget: float, *, certified: bool, multipliers, reduction: str, risk_model=None
) -> Probe:
    """One prompt's Probe from its per-layer ProbeResults. multipliers: the calibration's per-layer tensor or None."""
    error = probe_error(results)
    certificate = math.nan
    if certified and any(r is not None for r in results):
        ref = next(r for r in results if r is not None)
        shape = (len(results), ref.error.numel())
        nan = torch.full(shape, math.nan, dtype=torch.float64)
        stats = {k: nan.clone() for k in ("variance", "trace_c2", "out_norm")}
        for layer, r in enumerate(results):
            if r is not None:
                for k in stats:
                    stats[k][layer] = getattr(r, k).double().reshape(-1).cpu()
        certificate = float(token_certificate(stats, multipliers, reduction)[0])
    risk = risk_model(error, budget) if risk_model is not None and math.isfinite(error) else None
    return Probe(
        budget=budget,
        error=error,
        layers=layer_errors(results),
        certificate=certificate,
        calibrated=multipliers is not None,
        risk=risk,
    )


def choose_budget(errors: dict[float, float], tolerance: float) -> tuple[float, str]:
    """The smallest budget whose probe error is at most the tolerance; the full cache (1.0) when none is."""
    for budget in sorted(errors):
        if math.isfinite(errors[budget]) and errors[budget] <= tolerance:
            return budget, f"probe error {errors[budget]:.3g} <= tolerance {tolerance:g} at budget {budget:g}"
    return 1.0, f"no budget below the full cache has probe error <= tolerance {tolerance:g}"


def choose_rung(
    model, prompt, policy: Policy, tolerance: float, ladder, options=None
) -> tuple[BudgetChoice, object | None]:
    """The smallest rung of the ladder within tolerance by the probe, from one read of the prompt for every rung below
    the full cache. With decoding `options`, that read also keeps the chosen rung's cache (returned with the choice,
    so the prompt is read once); without, it is a probe-only read (None)."""
    from kvcert.hf import DecodeOptions, compress_while_reading, probe_prompt

    if not (isinstance(tolerance, (int, float)) and tolerance > 0):
        raise ValueError(f"tolerance must be a positive relative attention error (e.g. 0.1), got {tolerance!r}")
    rungs = sorted({float(b) for b in ladder})
    if not rungs or any(not 0.0 < b <= 1.0 for b in rungs):
        raise ValueError(f"the ladder's budgets must lie in (0, 1], got {list(ladder)}")
    if policy.is_full:
        raise ValueError("tolerance= chooses a budget for a compressing policy; the full cache has none to choose")
    below = [b for b in rungs if b < 1.0]
    candidates = [Policy(**{**asdict(policy), "budget": b}) for b in below]
    errors: dict[float, float] = {}

    def pick(probes) -> int | None:
        errors.update({b: probe_error(r) for b, r in zip(below, probes)})
        chosen = choose_budget(errors, tolerance)[0]
        return None if chosen >= 1.0 else below.index(chosen)

    batch = None
    if below and options is not None:
        batch = compress_while_reading(model, prompt, candidates, options, choose=pick)
    elif below:
        pick(probe_prompt(model, prompt, candidates, DecodeOptions(max_new_tokens=1, oracle=False)))
    chosen, why = choose_budget(errors, tolerance)
    # the read costs an extra prefill unless it also built the cache the answer is decoded from
    extra = len(prompt.input_ids) if below and batch is None else 0
    return BudgetChoice(
        tolerance=float(tolerance),
        ladder=rungs,
        errors={f"{b:g}": e for b, e in errors.items()},
        chosen=chosen,
        extra_prefill_tokens=extra,
        reason=why,
    ), batch
