"""Exploratory escalation study (kvcert.exploratory.escalation): the first firing index of each trigger, matched-rate
thresholds that escalate exactly the requested share, and the prefix + full-cache continuation equal to what
`generate` returns when it escalates at the same token."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvcert.exploratory import escalation as esc

NAN = float("nan")


def test_first_firing_skips_token_0_and_nan_and_is_strict():
    values = [9.0, 0.1, NAN, 0.5, 0.7, 0.2, 0.9]
    assert esc.first_firing(values, 0.5) == 4  # 0.5 is not above 0.5; token 0 never fires; NaN never fires
    assert esc.first_firing(values, 0.49) == 3
    assert esc.first_firing(values, 0.0) == 1
    assert esc.first_firing(values, 0.9) is None
    assert esc.first_firing([3.0], -1.0) is None  # a one-token answer cannot escalate
    assert esc.answer_max(values) == 0.9
    assert esc.answer_max([5.0, NAN]) == -math.inf


def _synthetic_base(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(1, 12))
        rows.append(
            dict(
                example_id=f"ex{i:03d}",
                certificate=[0.0, *rng.random(length - 1).tolist()],
                neg_logprob=[float(rng.random() * 9), *(rng.random(length - 1) * 3).tolist()],
            )
        )
    return pd.DataFrame(rows)


@pytest.mark.parametrize("rate", [0.1, 0.2, 0.3, 0.5])
def test_matched_thresholds_escalate_exactly_the_requested_share_at_the_first_firing(rate):
    base = _synthetic_base(40)
    firings = esc.rule_firings(base, [rate])
    target = round(rate * len(base))
    for signal, column in (("certificate", "certificate"), ("confidence", "neg_logprob")):
        f = firings[firings["signal"] == signal].set_index("example_id")
        assert f["k"].notna().sum() == target, signal
        t = float(f["threshold"].iloc[0])
        for eid, values in zip(base["example_id"], base[column], strict=True):
            k = f.loc[eid, "k"]
            over = [j for j in range(1, len(values)) if values[j] > t]
            if over:
                assert k == over[0]
                assert all(values[j] <= t for j in range(1, int(k)))
            else:
                assert math.isnan(k)
    r = firings[firings["signal"] == "random"].set_index("example_id")
    assert r["k"].notna().sum() == target
    lengths = base.set_index("example_id")["certificate"].map(len)
    for eid, k in r["k"].dropna().items():
        assert 1 <= k < lengths[eid]
    # the same seed draws the same subset
    again = esc.rule_firings(base, [rate])
    assert again[again["signal"] == "random"]["k"].fillna(-1).tolist() == r["k"].fillna(-1).tolist()


def test_matched_threshold_with_ties_never_escalates_more_than_asked():
    assert esc.matched_threshold([1.0, 1.0, 1.0, 1.0], 0.5) == 1.0  # 0 escalate rather than 4
    t = esc.matched_threshold([0.1, 0.2, 0.2, 0.4, 0.5], 0.4)
    assert (np.array([0.1, 0.2, 0.2, 0.4, 0.5]) > t).sum() == 2
    assert esc.matched_threshold([0.3, 0.1], 1.0) == -math.inf


def test_the_continuation_helper_equals_generate_escalating_at_the_same_token(tiny_smol):
    """Record a run without escalation, pick a confidence threshold that first fires at some k >= 2, and compare
    the recorded prefix + `escalated_answer` with `generate(..., escalate=Escalation(confidence, threshold))`."""
    from kvcert.bench.common import no_eos
    from kvcert.serve.generate import Escalation, generate
    from kvcert.tasks import make_examples

    model, tok = tiny_smol
    ex = make_examples("single_needle", 1, 300, tok, seed=6001)[0]
    args = dict(context=ex.context, question=ex.question, budget=0.25, calibration=None, max_new_tokens=10, seed=5)
    with no_eos(model):
        streamed = []
        plain = generate(model, tok, **args, on_token=streamed.append)
        nlp = [-t.logprob for t in streamed]
        k = next(j for j in range(2, len(nlp)) if nlp[j] > max(nlp[1:j]))
        threshold = max(nlp[1:k])
        assert esc.first_firing(nlp, threshold) == k
        escalated = generate(
            model, tok, **args, escalate=Escalation(signal="confidence", threshold=threshold, scope="token")
        )
        tokens, text = esc.escalated_answer(model, tok, context=ex.context, question=ex.question,
                                            prefix=plain.tokens[:k], max_new_tokens=10,
                                            prompt_format=esc.prompt_format_for(model))  # fmt: skip
    assert escalated.escalations[0].token == k
    assert tokens == escalated.tokens and text == escalated.text
    assert tokens[:k] == plain.tokens[:k] and len(tokens) > k
