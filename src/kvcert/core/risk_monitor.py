"""Watching a calibrated budget over a stream: a sequential test of "the stream's risk is at most alpha".

The user checks some answers against the full cache (loss 1: the answer differs, or the accuracy it lost) and feeds
each loss to `RiskMonitor.update`. The monitor bets against H0: E[loss_t | the past] <= alpha (testing by betting:
Shafer and Vovk; Waudby-Smith and Ramdas 2023, "Estimating means of bounded random variables by betting"): for each
bet size c in a fixed grid, the wealth prod_s (1 + (c / alpha)(loss_s - alpha)) (c < 1, so every factor is >= 1 - c
> 0) is a nonnegative supermartingale under H0, and so is their average. A wealth started at the first answer decays
while the stream is well inside the guarantee and would then be slow to see a later drift, so a new wealth process
starts every `window` answers: process k (k = 1, 2, ...; started after (k - 1) window answers) flags when its wealth
reaches k (k + 1) / delta. By Ville's inequality and a union bound (sum_k delta / (k (k + 1)) = delta), while the
stream's risk stays within alpha the monitor raises a false alarm with probability at most delta, however long the
stream and whenever it is read (anytime-valid; no i.i.d. assumption beyond the conditional mean). Only the `keep`
most recent processes are carried (dropping one can only lower the alarm probability). A stream that drifts above
alpha makes a recent process's wealth grow geometrically and is flagged. Once flagged it stays flagged (`reset()`
starts over, e.g. after recalibrating). Plain Python; `line()` is the one-line verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BETS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)  # bet sizes c (fractions of the largest safe bet 1 / alpha)


def _mean_wealth(log_wealth: list[float]) -> float:
    top = max(log_wealth)
    return math.exp(top) * sum(math.exp(w - top) for w in log_wealth) / len(log_wealth)


@dataclass
class RiskMonitor:
    alpha: float  # the guarantee's risk level
    delta: float = 0.05  # the monitor's false-alarm probability (over the whole stream)
    window: int = 50  # a new wealth process starts every `window` answers
    keep: int = 8  # the most recent processes carried
    bets: tuple[float, ...] = BETS
    processes: list[list] = field(default_factory=list)  # [k, [log wealth per bet]]
    n: int = 0
    total: float = 0.0
    flagged_at: int | None = None  # the answer (1-based) at which a process first reached its threshold
    evidence: tuple[float, float] = (1.0, math.inf)  # (e-value, threshold) of the process nearest its threshold

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0 or not 0.0 < self.delta < 1.0:
            raise ValueError(f"alpha={self.alpha!r} and delta={self.delta!r} must lie in (0, 1)")
        if not all(0.0 < c < 1.0 for c in self.bets) or self.window < 1 or self.keep < 1:
            raise ValueError("bets must lie in (0, 1), window and keep be at least 1")

    @property
    def flagged(self) -> bool:
        return self.flagged_at is not None

    @property
    def risk(self) -> float:
        return self.total / self.n if self.n else math.nan

    def update(self, loss: float) -> bool:
        """Feed one checked answer's loss in [0, 1]; True once the stream has left the guarantee."""
        loss = float(loss)
        if not 0.0 <= loss <= 1.0:
            raise ValueError(f"loss {loss!r} must lie in [0, 1] (1: the answer differs from the full cache's)")
        if self.n % self.window == 0:
            self.processes.append([self.n // self.window + 1, [0.0] * len(self.bets)])
            del self.processes[: -self.keep]
        self.n += 1
        self.total += loss
        best = (0.0, 1.0, math.inf)
        for k, logs in self.processes:
            for i, c in enumerate(self.bets):
                logs[i] += math.log1p(c / self.alpha * (loss - self.alpha))
            e, threshold = _mean_wealth(logs), k * (k + 1) / self.delta
            best = max(best, (e / threshold, e, threshold))
        self.evidence = best[1:]
        if self.flagged_at is None and best[0] >= 1.0:
            self.flagged_at = self.n
        return self.flagged

    def reset(self) -> None:
        self.processes, self.n, self.total, self.flagged_at, self.evidence = [], 0, 0.0, None, (1.0, math.inf)

    def line(self) -> str:
        """One line: within the guarantee or not, the realized risk and the test's evidence."""
        seen = f"{self.total:g} lost of {self.n} checked answers ({self.risk:.1%} vs alpha {self.alpha:.0%})"
        e, threshold = self.evidence
        if self.flagged:
            return (f"risk left the guarantee at answer {self.flagged_at}: {seen}; sequential test e-value "
                    f"{e:.3g} >= {threshold:g} (false-alarm rate <= {self.delta:g} over the stream); "
                    "recalibrate (kvcert calibrate-budget) on prompts like these")  # fmt: skip
        if not self.n:
            return f"no checked answers yet (alpha {self.alpha:.0%})"
        return f"risk within the guarantee so far: {seen}; e-value {e:.3g} < {threshold:g}"

    def state(self) -> dict:
        return {"alpha": self.alpha, "delta": self.delta, "window": self.window, "keep": self.keep,
                "bets": list(self.bets), "processes": self.processes, "n": self.n, "total": self.total,
                "flagged_at": self.flagged_at, "evidence": list(self.evidence)}  # fmt: skip

    @classmethod
    def from_state(cls, state: dict) -> RiskMonitor:
        return cls(**{**state, "bets": tuple(state["bets"]), "evidence": tuple(state["evidence"])})
