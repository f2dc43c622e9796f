"""Calibration of the per-token certificate: the file `kvcert calibrate` writes (`Calibration`: per-layer
split-conformal multipliers, the token reduction, escalation thresholds per rate and budget, the answer-level signals'
models) and the check that a file applies to a model, a policy and a budget. The fit itself (collecting examples with
the oracle on, the multipliers, the held-out report) is `kvcert.serve.calibration_fit`; its public names are
re-exported here.

    kvcert calibrate --model smollm2-135m-instruct [--tasks single_needle,fact_qa | --data file.jsonl] \
        [--budgets 0.25,0.5] [--n 20] [--seed 5000] [--draws 2 [--draws-variant split]] --out calib.json
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvcert.serve.calibration_fit import DEFAULT_RATES, calibration_fields, collect, fit, token_scores
from kvcert.serve.certificate import LEVEL

if TYPE_CHECKING:
    from kvcert.hf.draws import Draws

FORMAT = "kvcert-calibration/1"
DEFAULT_SEED = 5000  # calibration examples; the escalation study uses 6000 onwards
POLICY_FIELDS = ("scorer", "design", "tail_fraction", "floor", "score_power")
POLICY_DEFAULTS = {"allocation": "uniform", "recompress_every": None}  # matched too; absent from older files


class CalibrationError(ValueError):
    """A calibration file that cannot be used: one line naming the problem and the fix."""


@dataclass
class Calibration:
    model: str
    n_layers: int
    policy: dict  # POLICY_FIELDS of the policy the multipliers were fitted for
    budgets: list[float]  # the budgets fitted on; the file applies to budgets in [min, max]
    multipliers: list[float | None]  # per layer; None on layers kept exactly (never compressed)
    reduction: str = "max"
    level: float = LEVEL
    thresholds: dict[str, float] = field(default_factory=dict)  # target escalation rate -> certificate threshold
    # certificate thresholds per budget (budget -> rate -> threshold; the answer's score differs by budget, so one
    # pooled table escalates mostly the smallest budget's answers); used for a budget it holds, `thresholds` otherwise
    budget_thresholds: dict[str, dict[str, float]] = field(default_factory=dict)
    budget_thresholds_source: str = ""
    # the answer-level signals beyond the certificate: signal -> {rate: threshold}; and the logistic models of a
    # cache-induced failure: name ("probe", "combined") -> {"features", "mean", "scale", "coef", "intercept"}
    signal_thresholds: dict[str, dict[str, float]] = field(default_factory=dict)
    models: dict[str, dict] = field(default_factory=dict)
    # answer-level signals' thresholds per budget (signal -> budget -> rate -> threshold; today "agreement", whose
    # score falls with the budget as the certificate's does), used for a budget they hold
    signal_budget_thresholds: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # the draws the agreement thresholds were fitted with ({"count": R, "variant": ...}; {}: fitted without draws)
    draws: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    format: str = FORMAT

    # ----------------------------------------------------------------------------------------------- files
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        if not path.is_file():
            raise CalibrationError(f"calibration file {path} does not exist: pass a file `kvcert calibrate` wrote")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise CalibrationError(f"calibration file {path} is not JSON ({err}): rerun `kvcert calibrate`") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CalibrationError(f"{path} is not a kvcert calibration file (format {FORMAT}): rerun kvcert calibrate")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})

    # ------------------------------------------------------------------------------------------- matching
    def mismatch(self, model: str | None, n_layers: int, policy, budget: float) -> str | None:
        """Why this calibration does not apply to (model, policy, budget); None when it does."""
        if model is not None and model != self.model:
            return f"it was fitted for model {self.model!r}, not {model!r}"
        if n_layers != self.n_layers:
            return f"it has {self.n_layers} layers, the model {n_layers}"
        mine = {k: getattr(policy, k) for k in POLICY_FIELDS}
        if any(mine[k] != self.policy.get(k) for k in POLICY_FIELDS):
            return f"it was fitted for policy {self.policy}, not {mine}"
        for k, default in POLICY_DEFAULTS.items():  # files written before these fields were fitted at the defaults
            if getattr(policy, k) != self.policy.get(k, default):
                return f"it was fitted for {k}={self.policy.get(k, default)!r}, not {getattr(policy, k)!r}"
        lo, hi = min(self.budgets), max(self.budgets)
        if not lo - 1e-9 <= budget <= hi + 1e-9:
            return f"it was fitted for budgets {lo:g}-{hi:g}, not {budget:g}"
        return None

    def draws_mismatch(self, draws: Draws | None) -> str | None:
        """Why the agreement thresholds do not apply to `draws` (a kvcert.hf.draws.Draws): they were fitted with
        other draws (the disagreement of 2 draws and of 4, or of split halves, are different scores); None when
        they do."""
        mine = {"count": draws.count, "variant": draws.variant} if draws is not None else {}
        if self.draws == mine:
            return None
        fitted = f"{self.draws.get('count')} {self.draws.get('variant')} draws" if self.draws else "no draws"
        asked = f"{draws.count} {draws.variant} draws" if draws is not None else "none"
        return f"they were fitted with {fitted}, the request has {asked}"

    def multiplier_tensor(self) -> torch.Tensor:
        return torch.tensor([math.nan if m is None else m for m in self.multipliers], dtype=torch.float64)

    def signal_threshold(self, signal: str, rate: float, budget: float | None = None) -> float:
        """The threshold of an answer-level signal ("certificate", "probe", "combined", "agreement") that escalates
        a share `rate` of answers (the nearest fitted rate); the budget's own table when the file has one for
        `budget` (the certificate's `budget_thresholds`, the others' `signal_budget_thresholds`)."""
        if signal == "certificate":
            return self.threshold(rate, budget)
        by_budget = self.signal_budget_thresholds.get(signal, {})
        table = (by_budget.get(f"{budget:g}") if budget is not None else None) or self.signal_thresholds.get(signal)
        if not table:
            raise CalibrationError(f"this calibration file has no {signal} thresholds: rerun `kvcert calibrate`")
        nearest = min(table, key=lambda r: abs(float(r) - rate))
        return float(table[nearest])

    def _risk(self, name: str, values: dict[str, float]) -> float | None:
        model = self.models.get(name)
        if not model:
            return None
        x = [values[f] for f in model["features"]]
        if not all(math.isfinite(v) for v in x):
            return None
        z = model["intercept"] + sum(
            c * (v - m) / s for c, v, m, s in zip(model["coef"], x, model["mean"], model["scale"])
        )
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def probe_risk(self, error: float, budget: float) -> float | None:
        """P(cache-induced failure) from the prefill probe's error and the budget (None without a probe model)."""
        return self._risk("probe", {"probe_error": error, "budget": budget})

    def combined_risk(self, certificate: float, logprob: float, probe_error: float, budget: float) -> float | None:
        """P(cache-induced failure) from the answer's largest certificate, its lowest log-probability, the probe
        error and the budget: the combined signal (None without a combined model)."""
        values = {"certificate": certificate, "logprob": logprob, "probe_error": probe_error, "budget": budget}
        return self._risk("combined", values)

    def threshold(self, rate: float, budget: float | None = None) -> float:
        """The certificate threshold that escalates a share `rate` of answers (the nearest fitted rate), from the
        budget's own table when there is one (`budget_thresholds`), else the pooled one."""
        table = self.budget_thresholds.get(f"{budget:g}") if budget is not None else None
        table = table or self.thresholds
        if not table:
            raise CalibrationError("this calibration file has no escalation thresholds: rerun `kvcert calibrate`")
        nearest = min(table, key=lambda r: abs(float(r) - rate))
        return float(table[nearest])


def shipped(model: str) -> Calibration | None:
    """The calibration file shipped for a packaged model (kvcert/serve/calibrations/<model>.json), or None."""
    path = resources.files("kvcert.serve") / "calibrations" / f"{model}.json"
    return Calibration.load(Path(str(path))) if path.is_file() else None


def calibrate(model, tokenizer, model_name: str, examples, **kwargs) -> Calibration:
    """Collect and fit (`kvcert.serve.calibration_fit.calibration_fields`, which takes policy_fields=, budgets=,
    data= and optionally split_seed=, prompt_format=, work_dir=, log=, draws=: a kvcert.hf.draws.Draws also fits
    the agreement signal's thresholds per budget): the calibration `kvcert calibrate` saves."""
    return Calibration(**calibration_fields(model, tokenizer, model_name, examples, **kwargs))


__all__ = [
    "DEFAULT_RATES",
    "DEFAULT_SEED",
    "FORMAT",
    "POLICY_FIELDS",
    "Calibration",
    "CalibrationError",
    "calibrate",
    "collect",
    "describe",
    "fit",
    "shipped",
    "token_scores",
]


def describe(cal: Calibration) -> str:
    """The calibration report in a few lines (what `kvcert calibrate` prints)."""
    r = cal.report
    lines = [
        f"calibration of {cal.model}: {cal.policy['scorer']} x {cal.policy['design']} at budgets "
        f"{', '.join(f'{b:g}' for b in cal.budgets)}, level {cal.level}",
        f"  data: {cal.data}",
        f"  held-out coverage of m_layer * r_tight: {r['coverage']:.3f} [{r['coverage_ci'][0]:.3f}, "
        f"{r['coverage_ci'][1]:.3f}] over {r['n_test_cells']} cells of {r['n_test_examples']} examples; worst layer "
        f"{r['worst_layer']['layer']}: {r['worst_layer']['coverage']:.3f}; worst tail-mass bin "
        f"{r['worst_tail_mass_bin']['tail_mass'][0]:.3g}-{r['worst_tail_mass_bin']['tail_mass'][1]:.3g}: "
        f"{r['worst_tail_mass_bin']['coverage']:.3f}",
        f"  token certificate: {cal.reduction} (held-out AUROC for cache-induced failures: "
        + ", ".join(f"{k} {v:.3f}" for k, v in r["auroc"].items())
        + f"; {r['n_test_cache_failures']} failures in {r['n_test_answers']} answers the full cache got right)",
        "  escalation thresholds (rate: threshold, held-out rate): "
        + ", ".join(f"{k}: {v:.3g} ({r['held_out_escalation_rate'][k]:.2f})" for k, v in cal.thresholds.items()),
    ]
    if "agreement" in cal.signal_thresholds:
        lines.append(
            f"  agreement thresholds ({cal.draws.get('count')} {cal.draws.get('variant')} draws; budget: rate: "
            "threshold): "
            + "; ".join(
                f"{b}: " + ", ".join(f"{k}: {v:.3g}" for k, v in table.items())
                for b, table in cal.signal_budget_thresholds.get("agreement", {}).items()
            )
        )
    if "signal_auroc" in r:
        lines.append(
            "  held-out AUROC of each answer-level signal for cache-induced failures: "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["signal_auroc"].items())
        )
        lines.append(
            "  tolerance t -> mean budget taken, share at the full cache, accuracy, cache-induced failure rate: "
            + "; ".join(
                f"{t}: {v['mean_budget']:.2f}, {v['share_full']:.2f}, {v['accuracy']:.2f}, "
                f"{v['cache_failure_rate']:.2f}"
                for t, v in r["tolerance"].items()
            )
        )
    return "\n".join(lines)
