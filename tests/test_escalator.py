"""RateEscalator: a stream holds the declared escalation rate whatever its signal distribution, starting from the
calibration's threshold; decisions never depend on their own signal; ties, persistence and argument checks."""

import json
import math
from statistics import NormalDist

import numpy as np
import pytest

from kvcert.serve.escalator import RateEscalator

RATE = 0.2
CALIBRATED = NormalDist().inv_cdf(1 - RATE)  # the calibration's threshold: the 0.8 quantile of N(0, 1)


def run(esc: RateEscalator, signals) -> np.ndarray:
    return np.array([esc.decide(float(s)) for s in signals])


def test_holds_the_rate_on_a_stream_unlike_the_calibration():
    signals = np.random.default_rng(1).normal(1.0, 1.0, 5000)  # the stream sits one sd above the calibration's
    esc = RateEscalator(rate=RATE, threshold=CALIBRATED)
    decisions = run(esc, signals)
    assert abs(decisions.mean() - RATE) < 0.02
    assert esc.realized_rate == pytest.approx(decisions.mean())
    assert esc.seen == 5000 and esc.escalated == decisions.sum()
    # the fixed calibrated threshold escalates ~56% of this stream (P(N(1,1) > 0.84)): the test can fail
    fixed = (signals > CALIBRATED).mean()
    assert fixed > 0.5 and abs(fixed - (1 - NormalDist(1.0, 1.0).cdf(CALIBRATED))) < 0.02


def test_follows_a_shift_mid_stream():
    rng = np.random.default_rng(2)
    signals = np.concatenate([rng.normal(0.0, 1.0, 2000), rng.normal(2.0, 1.0, 2000)])
    decisions = run(RateEscalator(rate=RATE, threshold=CALIBRATED), signals)
    assert abs(decisions[-1000:].mean() - RATE) < 0.03
    assert abs(decisions[1000:2000].mean() - RATE) < 0.03  # before the shift too
    assert (signals[-1000:] > CALIBRATED).mean() > 0.8  # what the fixed threshold would do after the shift


def test_threshold_is_the_window_quantile_after_warmup():
    # an independent computation: numpy's inverted-CDF quantile of the last `window` recorded signals
    signals = np.random.default_rng(3).normal(0.5, 2.0, 700)
    esc = RateEscalator(rate=RATE, threshold=CALIBRATED, window=200, warmup=20)
    for i, s in enumerate(signals):
        if i >= 200:
            expected = np.quantile(signals[i - 200 : i], 1 - RATE, method="inverted_cdf")
            assert esc.threshold == expected
            assert esc.decide(s) == (s > expected)
        else:
            esc.decide(s)
    assert esc.recent == list(signals[-200:])


def test_warmup_blends_from_the_calibration_threshold():
    signals = np.random.default_rng(4).normal(3.0, 1.0, 30)
    esc = RateEscalator(rate=RATE, threshold=CALIBRATED, warmup=20)
    assert esc.threshold == CALIBRATED  # the first decision uses the calibration's threshold exactly
    for n, s in enumerate(signals):
        q = np.quantile(signals[:n], 1 - RATE, method="inverted_cdf") if n else CALIBRATED
        w = min(1.0, n / 20)
        assert esc.threshold == pytest.approx(CALIBRATED + w * (q - CALIBRATED), abs=1e-12)
        esc.decide(s)
    # warmup=0: the window alone from the first recorded signal
    esc = RateEscalator(rate=RATE, threshold=CALIBRATED, warmup=0)
    assert esc.threshold == CALIBRATED
    esc.decide(7.0)
    assert esc.threshold == 7.0


def test_first_decision_uses_the_calibration_threshold():
    below, above = CALIBRATED - 1e-9, CALIBRATED + 1e-9
    assert RateEscalator(rate=RATE, threshold=CALIBRATED).decide(above) is True
    assert RateEscalator(rate=RATE, threshold=CALIBRATED).decide(below) is False


def test_a_decision_does_not_depend_on_its_own_signal():
    esc = RateEscalator(rate=RATE, threshold=CALIBRATED)
    run(esc, np.random.default_rng(5).normal(0.0, 1.0, 300))
    before = esc.threshold
    saved = esc.state()
    for x in (1e12, before + 1e-9, before - 1e-9, -1e12):
        clone = RateEscalator.from_state(saved)
        assert clone.threshold == before
        assert clone.decide(x) == (x > before)
    # recording the signal does move the bar, for the next answer only
    esc.decide(1e12)
    assert esc.threshold != before


def test_nan_signals_never_escalate_and_are_not_recorded():
    esc = RateEscalator(rate=RATE, threshold=CALIBRATED)
    run(esc, [0.1, 2.0])
    before, recent = esc.threshold, esc.recent
    assert esc.decide(math.nan) is False
    assert esc.threshold == before and esc.recent == recent and esc.seen == 2 and esc.skipped == 1


def test_a_constant_stream_escalates_at_the_rate_reproducibly():
    decisions = run(RateEscalator(rate=RATE, threshold=0.5, seed=7), [1.0] * 2000)
    assert abs(decisions.mean() - RATE) < 0.03  # not 100% (strict >) or 0% forever
    assert abs(decisions[200:].mean() - RATE) < 0.03  # past warmup, not only on average
    again = run(RateEscalator(rate=RATE, threshold=0.5, seed=7), [1.0] * 2000)
    assert (decisions == again).all()
    other = run(RateEscalator(rate=RATE, threshold=0.5, seed=8), [1.0] * 2000)
    assert not (decisions == other).all()


def test_state_round_trip_continues_identically():
    rng = np.random.default_rng(6)
    first, rest = rng.normal(0.0, 1.0, 250), np.round(rng.normal(1.0, 1.0, 500), 1)  # rounded: ties draw the rng
    esc = RateEscalator(rate=0.3, threshold=0.5, window=50, warmup=10, seed=3)
    run(esc, first)
    esc.decide(math.nan)
    restored = RateEscalator.from_state(json.loads(json.dumps(esc.state())))
    assert restored.state() == esc.state()
    assert (run(restored, rest) == run(esc, rest)).all()
    assert restored.state() == esc.state()
    assert restored.threshold == esc.threshold and restored.seen == esc.seen == 750
    with pytest.raises(ValueError, match="format"):
        RateEscalator.from_state({**esc.state(), "format": "other"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0}, r"rate=0.0 is not a share in \(0, 1\)"),
        ({"rate": 1.0}, r"rate=1.0 is not a share in \(0, 1\)"),
        ({"rate": math.nan}, r"rate=nan is not a share in \(0, 1\)"),
        ({"threshold": math.inf}, r"threshold=inf is not a finite number: pass the calibration's threshold"),
        ({"threshold": math.nan}, r"threshold=nan is not a finite number"),
        ({"window": 0}, r"window=0 must be an integer >= 1"),
        ({"window": 2.5}, r"window=2.5 must be an integer >= 1"),
        ({"warmup": -1}, r"warmup=-1 must be an integer >= 0"),
    ],
)
def test_bad_arguments_raise_one_clear_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        RateEscalator(**{"rate": RATE, "threshold": CALIBRATED, **kwargs})
    assert "\n" not in str(info.value)
