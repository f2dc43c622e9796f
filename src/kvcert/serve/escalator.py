"""A rate-holding escalator: escalate a declared share of a stream's answers, whatever the stream's signals look like.

A calibrated threshold holds its rate only on the calibration's workload: on one user's document every call may
cross it, on another set of prompts a different share. `RateEscalator` starts from the calibration's threshold and
then follows the empirical (1 - rate) quantile of the signal over the last `window` answers, so the share escalated
tracks `rate` on the stream actually served.

    esc = RateEscalator(rate=0.2, threshold=calibration.threshold(0.2, budget))
    for prompt in stream:
        ...
        if esc.decide(signal):
            ...  # restart the answer with the full cache

Rules (why each is what it is):

- The quantile. The window's threshold is the smallest recorded value t with at most rate * n of the window's n
  values strictly above it: numpy's `quantile(window, 1 - rate, method="inverted_cdf")`, an order statistic of the
  window (no interpolation, so ties in the signal stay ties at the threshold; see the tie rule). On an exchangeable
  continuous stream the next answer exceeds it with probability (floor(rate * n) + 1) / (n + 1): at most
  1 / (n + 1) above `rate` (0.005 with the default window of 200).
- Warmup: a linear blend. After `seen` signals the threshold is cal + w * (q - cal), w = min(1, seen / warmup), cal
  the calibration's threshold and q the window's quantile. The first decision therefore uses the calibration's
  threshold exactly, and from `warmup` signals on the window's own quantile alone. The blend rather than a hard
  switch because the failing case is a short stream that the calibration misjudges (14 of 14 calls on one
  document): the threshold moves toward the stream from the second answer, while the few-sample quantile (the
  window's extreme values when n is small) gets only a small weight.
- Ties. A signal exactly equal to the current threshold escalates with probability p = (rate * n - above) / equal,
  clipped to [0, 1], where above and equal count the window's values strictly above and equal to the threshold:
  the probability that makes the window's expected escalated share exactly `rate`. A constant stream then
  escalates a share `rate` (not 0% or 100% forever). With an empty window p = rate. The draw comes from
  `random.Random(seed)`, consumed only on ties, so decisions are reproducible given the seed and the stream.
- A decision uses the threshold before its own signal is recorded, so no answer moves the bar it is judged by.
- NaN signals (no signal for this answer) never escalate and are not recorded; they are counted in `skipped`, not
  in `seen` or `realized_rate`. +-inf signals are recorded (+inf always escalates).
- No controller term. An integral term on the cumulative realized rate would make later answers pay for an
  earlier burst (after a distribution shift the window needs ~rate * window answers to catch up, and a controller
  would then escalate too few for as long), and it winds up on long streams; the window quantile already holds the
  rate within 1 / (n + 1) plus sampling noise.

`state()` is a JSON-able dict (the window, counts, the tie generator's state and the signal) and `from_state`
rebuilds an escalator that continues identically, so a server can persist it across restarts. Plain Python: no torch.

`signal` names the answer-level score `kvcert.generate(..., escalate=RateEscalator(...))` feeds it, once per answer
it could restart: "certificate" (the answer's largest token certificate), "agreement" (the draws' disagreement,
with draws=) or "confidence" (minus the answer's lowest log-probability over its cache-dependent tokens).
"""

from __future__ import annotations

import bisect
import math
import numbers
import random
from collections import deque
from typing import Any

FORMAT = "kvcert-escalator/1"
DEFAULT_WINDOW = 200
DEFAULT_WARMUP = 20  # ~4 expected escalations at rate 0.2 before the stream's own quantile is trusted alone
ESCALATOR_SIGNALS = ("certificate", "agreement", "confidence")  # the answer's scores generate can feed it
_EPS = 1e-9  # rate * n is an integer in exact arithmetic more often than in floating point (0.2 * 35)


class RateEscalator:
    """Escalate a share `rate` of a stream's answers: the threshold starts at the calibration's `threshold` and
    follows the (1 - rate) quantile of the last `window` signals (module docstring: blend, ties, NaN)."""

    def __init__(
        self,
        rate: float,
        threshold: float,
        window: int = DEFAULT_WINDOW,
        warmup: int = DEFAULT_WARMUP,
        seed: int = 0,
        signal: str = "certificate",
    ) -> None:
        _validate(rate, threshold, window, warmup)
        if signal not in ESCALATOR_SIGNALS:
            raise ValueError(f"signal={signal!r}: choose one of {', '.join(ESCALATOR_SIGNALS)} (the answer's score)")
        self.signal = signal
        self.rate = float(rate)
        self.calibration_threshold = float(threshold)
        self.window = int(window)
        self.warmup = int(warmup)
        self.seed = seed
        self._recent: deque[float] = deque()  # the window in arrival order (oldest first)
        self._sorted: list[float] = []  # the same values sorted, for the order statistic and the tie counts
        self._seen = 0
        self._escalated = 0
        self._skipped = 0
        self._rng = random.Random(seed)

    # -------------------------------------------------------------------------------------------------- readings
    @property
    def threshold(self) -> float:
        """The threshold the next decision uses."""
        if not self._sorted:
            return self.calibration_threshold
        w = 1.0 if self.warmup == 0 else min(1.0, self._seen / self.warmup)
        q = self._window_quantile()
        if w >= 1.0:
            return q  # exactly the window's order statistic: ties with it are detectable
        return self.calibration_threshold + w * (q - self.calibration_threshold)

    @property
    def seen(self) -> int:
        """Signals decided and recorded (NaN signals excluded)."""
        return self._seen

    @property
    def skipped(self) -> int:
        """NaN signals: decided (never escalated) but not recorded."""
        return self._skipped

    @property
    def escalated(self) -> int:
        return self._escalated

    @property
    def realized_rate(self) -> float:
        """Share of the recorded signals that escalated so far (NaN before any; NaN signals not counted)."""
        return self._escalated / self._seen if self._seen else math.nan

    @property
    def recent(self) -> list[float]:
        """The window's signals, oldest first."""
        return list(self._recent)

    # -------------------------------------------------------------------------------------------------- decision
    def decide(self, signal: float) -> bool:
        """Whether this answer escalates: signal above the current threshold (a tie: with the probability that
        holds the rate). The threshold is read before the signal is recorded; a NaN signal never escalates and is
        not recorded."""
        signal = float(signal)
        if math.isnan(signal):
            self._skipped += 1
            return False
        t = self.threshold
        if signal > t:
            escalate = True
        elif signal == t:
            escalate = self._rng.random() < self._tie_probability(t)
        else:
            escalate = False
        self._record(signal)
        self._escalated += escalate
        return escalate

    def _tie_probability(self, t: float) -> float:
        n = len(self._sorted)
        if n == 0:
            return self.rate
        lo = bisect.bisect_left(self._sorted, t)
        hi = bisect.bisect_right(self._sorted, t)
        equal, above = hi - lo, n - hi
        if equal == 0:  # a blended threshold that happens to equal the signal: no window atom to share
            return self.rate
        return min(1.0, max(0.0, (self.rate * n - above) / equal))

    def _window_quantile(self) -> float:
        # smallest value with at most rate * n values strictly above: position floor(rate * n) from the top
        n = len(self._sorted)
        k = min(n - 1, math.floor(self.rate * n + _EPS))
        return self._sorted[n - 1 - k]

    def _record(self, signal: float) -> None:
        if len(self._recent) == self.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(signal)
        bisect.insort(self._sorted, signal)
        self._seen += 1

    # --------------------------------------------------------------------------------------------- persistence
    def state(self) -> dict[str, Any]:
        """A JSON-able dict from which `from_state` continues identically (json.dumps writes +-inf signals as
        Infinity, which json.loads reads back)."""
        version, internal, gauss_next = self._rng.getstate()
        return {
            "format": FORMAT,
            "rate": self.rate,
            "threshold": self.calibration_threshold,
            "window": self.window,
            "warmup": self.warmup,
            "seed": self.seed,
            "recent": list(self._recent),
            "seen": self._seen,
            "escalated": self._escalated,
            "skipped": self._skipped,
            "rng": [version, list(internal), gauss_next],
            "signal": self.signal,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RateEscalator:
        """The escalator `state()` was taken from, continuing where it stopped."""
        if state.get("format") != FORMAT:
            raise ValueError(
                f"escalator state has format {state.get('format')!r}, expected {FORMAT!r}: pass a dict written by "
                "RateEscalator.state()"
            )
        # "signal" was added later: a state written before it is the certificate's
        esc = cls(state["rate"], state["threshold"], state["window"], state["warmup"], state["seed"],
                  signal=state.get("signal", "certificate"))  # fmt: skip
        recent = [float(x) for x in state["recent"]]
        if len(recent) > esc.window or any(math.isnan(x) for x in recent):
            raise ValueError(
                f"escalator state holds {len(recent)} recent signals for a window of {esc.window} (or a NaN): "
                "pass an unmodified RateEscalator.state() dict"
            )
        esc._recent = deque(recent)
        esc._sorted = sorted(recent)
        esc._seen = int(state["seen"])
        esc._escalated = int(state["escalated"])
        esc._skipped = int(state["skipped"])
        version, internal, gauss_next = state["rng"]
        esc._rng.setstate((version, tuple(internal), gauss_next))
        return esc

    def __repr__(self) -> str:
        return (
            f"RateEscalator(signal={self.signal!r}, rate={self.rate}, threshold={self.threshold!r}, "
            f"calibration_threshold={self.calibration_threshold!r}, window={self.window}, warmup={self.warmup}, "
            f"seen={self._seen}, realized_rate={self.realized_rate:.3f})"
        )


def _validate(rate: float, threshold: float, window: int, warmup: int) -> None:
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 < rate < 1.0:
        raise ValueError(f"rate={rate!r} is not a share in (0, 1): pass the fraction of answers to escalate, e.g. 0.2")
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not math.isfinite(threshold):
        raise ValueError(
            f"threshold={threshold!r} is not a finite number: pass the calibration's threshold for this rate "
            "(Calibration.threshold(rate, budget))"
        )
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(f"window={window!r} must be an integer >= 1: the number of recent answers, e.g. 200")
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an integer >= 0: answers before the window is trusted, e.g. 20")
