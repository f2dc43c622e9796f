"""Several draws in `kvcert.generate` (draws=): draw 0's answer is one draw's, the other rows' log-probabilities
are the teacher-forced ones of kvcert.hf, the KV reported is the rows' union; the agreement signal's escalation,
its calibration (`kvcert calibrate --draws`) and its refusals; a RateEscalator asked once per answer; the CLI."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pandas as pd
import pytest

import kvcert.serve
from conftest import hf_greedy
from kvcert import Calibration, CalibrationError, Draws, Escalation, Policy, RateEscalator, generate
from kvcert.bench.common import no_eos
from kvcert.hf import DecodeOptions, Prompt, compress_while_reading, generate_variants
from kvcert.hf.draws import draw_policies, union_kv_bytes
from kvcert.serve import calibration as calibration_module
from kvcert.serve.cli import main
from kvcert.serve.generate import build_prompt, default_policy, kv_bytes
from kvcert.tasks import make_examples

SMOL = "smollm2-135m-instruct"
STEPS = 8


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no calibration": these tests read the uncalibrated radius
        yield


def _ask(tok, seed: int = 7011) -> dict:
    ex = make_examples("single_needle", 1, 300, tok, seed=seed)[0]
    return dict(context=ex.context, question=ex.question)


def _calibration(model, **overrides) -> Calibration:
    n = model.config.num_hidden_layers
    fields = {k: getattr(default_policy(0.25), k) for k in calibration_module.POLICY_FIELDS}
    args = dict(model="tiny", n_layers=n, policy=fields, budgets=[0.25, 0.5], multipliers=[1.5] * n,
                thresholds={"0.2": 1e9})  # fmt: skip
    return Calibration(**{**args, **overrides})


def _reference(model, tok, ask: dict, rows, follow, seed: int = 0):
    """The rows decoded by kvcert.hf directly from generate's prompt and seeds: (results, the serving batch)."""
    ids, qs, stops = build_prompt(tok, **ask, messages=None, prompt_format="auto")
    prompt = Prompt(input_ids=ids, question_start=qs, example_id=f"kvcert-generate-{seed}")
    opts = DecodeOptions(max_new_tokens=STEPS, stop_strings=tuple(stops), oracle=False)
    results = generate_variants(model, tok, prompt, rows, opts, follow=follow)
    return results, compress_while_reading(model, prompt, rows, opts), ids


def test_without_draws_generate_is_one_draw_as_before(tiny_smol):
    """draws=None: the tokens, log-probabilities and KV bytes of one row decoded by kvcert.hf (what generate did
    before draws existed); no agreement, and the summary says nothing of draws."""
    model, tok = tiny_smol
    ask = _ask(tok)
    policy = default_policy(0.25)
    with no_eos(model):
        out = generate(model, tok, **ask, policy=policy, calibration=None, escalate=None, max_new_tokens=STEPS)
        same = generate(model, tok, **ask, policy=policy, calibration=None, escalate=None, max_new_tokens=STEPS,
                        draws=None)  # fmt: skip
        (ref,), batch, _ = _reference(model, tok, ask, [policy], None)
    assert out.tokens == same.tokens == ref.tokens and out.logprobs == same.logprobs == ref.logprobs
    assert out.kv_bytes == same.kv_bytes == kv_bytes(batch)
    assert out.draws is None and out.agreement is None and "draws" not in out.summary()
    assert out.confidence == pytest.approx(-min(ref.logprobs[1:]))  # the first token is read exactly


@pytest.mark.parametrize("variant", ["independent", "split"])
def test_draw_zero_is_the_answer_and_the_others_are_teacher_forced(tiny_smol, variant):
    """draws=2 (or the split halves): the answer, its log-probabilities and certificates are draws=None's (draw 0 is
    the policy with generate's seeds); agreement.logprobs are the followers' from generate_variants(follow=...);
    kv_bytes is union_kv_bytes with each row's reserved answer slots: between one draw's and twice it for two
    independent draws, exactly the halves' extra answer slots above one draw for the split halves."""
    model, tok = tiny_smol
    ask = _ask(tok)
    policy = default_policy(0.25)
    draws = Draws(variant=variant)
    kw = dict(policy=policy, calibration=None, escalate=None, max_new_tokens=STEPS)
    with no_eos(model):
        one = generate(model, tok, **ask, **kw)
        out = generate(model, tok, **ask, **kw, draws=2 if variant == "independent" else draws)
        rows, follow = draw_policies(policy, draws)
        results, batch, _ = _reference(model, tok, ask, rows, follow)
    assert out.draws == draws and rows[0] == policy
    assert out.tokens == one.tokens == results[0].tokens and out.logprobs == results[0].logprobs
    # one draw alone is a narrower bucket: the kernels' sums run over other padding, so float rounding differs
    assert out.logprobs == pytest.approx(one.logprobs, abs=1e-5)
    assert out.certificate == pytest.approx(one.certificate, rel=1e-5)  # a bucket's statistics: float rounding
    assert out.agreement.logprobs == [r.logprobs for r in results[1:]]
    span = range(*out.agreement.span)
    assert out.agreement.span == (1, STEPS)  # no EOS: the answer is every token but the first (read exactly)
    drops = [max(results[0].logprobs[t] - r.logprobs[t] for t in span) for r in results[1:]]
    assert out.agreement.drops == pytest.approx(drops) and out.agreement.disagreement == pytest.approx(np.mean(drops))
    assert out.agreement.row_differs == [r.own_tokens[1:STEPS] != out.tokens[1:STEPS] for r in results[1:]]
    assert out.confidence == out.agreement.confidence == one.confidence
    slots = STEPS + 1
    assert out.kv_bytes == union_kv_bytes(batch, list(range(len(rows))), {i: slots for i in range(len(rows))})
    alone = union_kv_bytes(batch, [0], {0: slots})
    cfg = model.config
    per_slot = 2 * cfg.head_dim * 4 * cfg.num_hidden_layers * cfg.num_key_value_heads  # K and V, float32, a row
    if variant == "split":
        assert out.kv_bytes == alone + 2 * slots * per_slot
    else:
        assert one.kv_bytes < out.kv_bytes < 2 * one.kv_bytes and alone < out.kv_bytes < 2 * alone
    assert f"draws: {'split halves of one draw' if variant == 'split' else '2 independent'}, disagreement" in (
        out.summary()
    )


def test_the_agreement_signal_restarts_exactly_above_its_threshold(tiny_smol):
    """Escalation(signal="agreement"): no restart at a threshold equal to the disagreement, a restart just below it,
    and the restarted answer is the full cache's greedy answer; the agreement reported is the discarded answer's."""
    model, tok = tiny_smol
    ask = _ask(tok, seed=7012)
    kw = dict(budget=0.25, calibration=None, max_new_tokens=STEPS, draws=2)
    with no_eos(model):
        base = generate(model, tok, **ask, escalate=None, **kw)
        d = base.agreement.disagreement
        kept = generate(model, tok, **ask, escalate=Escalation(signal="agreement", threshold=d), **kw)
        events = []
        below = Escalation(signal="agreement", threshold=math.nextafter(d, -math.inf))
        restarted = generate(model, tok, **ask, escalate=below, on_token=events.append, **kw)
        ids, _, _ = build_prompt(tok, **ask, messages=None, prompt_format="auto")
        ref, _ = hf_greedy(model, ids, STEPS)
    assert d > 0 and not kept.escalations and kept.tokens == base.tokens
    (esc,) = restarted.escalations
    assert (esc.token, esc.scope, esc.budget_to, esc.discarded) == (0, "answer", 1.0, STEPS)
    assert "disagreement" in esc.reason and esc.threshold == below.threshold
    assert restarted.tokens == ref and all(t.budget == 1.0 for t in restarted.steps)
    assert restarted.agreement.disagreement == d and "the discarded answer's draws: 2 independent" in (
        restarted.summary()
    )
    assert len(events) == 2 * STEPS + 1  # draw 0's tokens streamed, the restart, the full cache's answer


def test_the_agreement_threshold_comes_from_a_calibration_with_the_same_draws(tiny_smol):
    model, tok = tiny_smol
    ask = _ask(tok, seed=7013)
    table = {"0.25": {"0.1": 1e9, "0.2": -1.0}, "0.5": {"0.2": 1e9}}
    cal = _calibration(model, signal_thresholds={"agreement": {"0.2": 1e9}}, signal_budget_thresholds={
        "agreement": table}, draws={"count": 2, "variant": "independent"})  # fmt: skip
    kw = dict(budget=0.25, model_name="tiny", max_new_tokens=4)
    with no_eos(model):
        out = generate(model, tok, **ask, calibration=cal, escalate=Escalation(signal="agreement"), draws=2, **kw)
    assert out.threshold == -1.0 and out.escalations[0].budget_to == 1.0  # the budget's own table, rate 0.2
    with pytest.raises(CalibrationError, match=r"fitted with 2 independent draws, the request has 3 independent"):
        generate(model, tok, **ask, calibration=cal, escalate=Escalation(signal="agreement"), draws=3, **kw)
    plain = _calibration(model)
    with pytest.raises(CalibrationError, match=r"pass Escalation\(signal='agreement', threshold=...\) .*`kvcert "
                       r"calibrate --draws 2 --draws-variant independent`"):  # fmt: skip
        generate(model, tok, **ask, calibration=plain, escalate=Escalation(signal="agreement"), draws=2, **kw)


def test_answer_level_confidence_leaves_out_the_first_token_read_with_the_prompt(tiny_smol):
    """The first token comes from exact attention over the prompt (compress_after="prompt"): its log-probability is
    the same at every budget, so neither Generation.confidence nor the answer-scope confidence signal counts it. On
    this prompt the first token is the least likely: a threshold between it and the rest restarts nothing."""
    model, tok = tiny_smol
    ask = _ask(tok, seed=7025)
    kw = dict(budget=0.25, calibration=None, max_new_tokens=STEPS)
    with no_eos(model):
        base = generate(model, tok, **ask, escalate=None, **kw)
        rest = max(-lp for lp in base.logprobs[1:])
        assert -base.logprobs[0] > rest and base.confidence == rest
        between = Escalation(signal="confidence", threshold=(rest - base.logprobs[0]) / 2)
        kept = generate(model, tok, **ask, escalate=between, **kw)
        below = Escalation(signal="confidence", threshold=math.nextafter(rest, -math.inf))
        restarted = generate(model, tok, **ask, escalate=below, **kw)
    assert not kept.escalations and kept.tokens == base.tokens
    assert restarted.escalations[0].scope == "answer" and "log-probability" in restarted.escalations[0].reason


def test_bad_draws_and_agreement_requests_are_one_clear_error(tiny_smol):
    model, tok = tiny_smol
    ask = _ask(tok)
    kw = dict(budget=0.25, calibration=None, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"needs scope='answer'"):
        Escalation(signal="agreement", threshold=1.0, scope="token")
    with pytest.raises(ValueError, match=r"Escalation\(signal='agreement'\) needs several draws .*pass draws=2"):
        generate(model, tok, **ask, escalate=Escalation(signal="agreement", threshold=1.0), **kw)
    with pytest.raises(ValueError, match=r"RateEscalator\(signal='agreement'\) needs .*pass draws=2"):
        generate(model, tok, **ask, escalate=RateEscalator(0.2, 1.0, signal="agreement"), **kw)
    with pytest.raises(ValueError, match="at least 2 draws"):
        generate(model, tok, **ask, draws=1, **kw)
    with pytest.raises(ValueError, match="pass None"):
        generate(model, tok, **ask, draws="2", **kw)
    topk = Policy(scorer="window_question", design="topk", budget=0.25)
    with pytest.raises(ValueError, match="whole randomized policy"):
        generate(model, tok, **ask, draws=2, policy=topk, calibration=None, max_new_tokens=2)
    with pytest.raises(ValueError, match="choose one of certificate, agreement, confidence"):
        RateEscalator(0.2, 1.0, signal="probe")


class _Spy(RateEscalator):
    """A RateEscalator that records every signal it is asked about."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[float] = []

    def decide(self, signal: float) -> bool:
        self.asked.append(signal)
        return super().decide(signal)


@pytest.mark.parametrize("signal", ["certificate", "agreement", "confidence"])
def test_generate_asks_the_rate_escalator_once_per_answer(tiny_smol, signal):
    """Each call asks decide once with the answer's signal (its largest certificate, the disagreement, or its
    confidence); an answer it escalates restarts with the full cache (full-cache greedy); the summary gives the
    realized rate; the escalator's state round-trips with its signal."""
    model, tok = tiny_smol
    ask = _ask(tok, seed=7014)
    esc = _Spy(rate=0.5, threshold=1e9, warmup=0, signal=signal)  # warmup 0: the window's own quantile at once
    kw = dict(budget=0.25, calibration=None, max_new_tokens=STEPS, escalate=esc, draws=2)
    with no_eos(model):
        first = generate(model, tok, **ask, **kw)  # above a threshold of 1e9: nothing escalates
        second = generate(model, tok, **ask, **kw)  # the same signal ties the window's one value: rate 0.5 x 1
        ids, _, _ = build_prompt(tok, **ask, messages=None, prompt_format="auto")
        ref, _ = hf_greedy(model, ids, STEPS)
    finite = [c for c in first.certificate if math.isfinite(c)]
    want = {"certificate": max(finite), "agreement": first.agreement.disagreement, "confidence": first.confidence}[
        signal
    ]
    assert esc.asked == [want, want] and not first.escalations
    assert first.escalator["value"] == want and first.escalator["threshold"] == 1e9
    assert first.escalation.signal == signal and first.threshold == 1e9
    assert second.escalator["threshold"] == want  # the window's quantile: its one value
    escalated = bool(second.escalations)
    assert second.escalator["escalated"] == escalated and esc.escalated == int(escalated)
    if escalated:
        assert second.tokens == ref and "rate escalator" in second.escalations[0].reason
    assert f"escalated {int(escalated)} of 2 answers ({int(escalated) / 2:.0%}), target 50%" in second.summary()
    assert RateEscalator.from_state(json.loads(json.dumps(esc.state()))).signal == signal


def test_a_rate_escalator_holds_its_rate_over_a_stream_of_calls(tiny_smol):
    """30 calls (one prompt, 30 design seeds): generate's decisions are the escalator's own over the answers'
    largest certificates (a fresh escalator fed the same signals decides the same), every escalated answer is the
    full cache's, and the realized rate is near the target."""
    model, tok = tiny_smol
    ask = _ask(tok, seed=7015)
    # the starting threshold plays the calibration's: near the 80th percentile of this prompt's answers' largest
    # (uncalibrated) certificates on the tiny model; the default window and warmup
    esc, replay = RateEscalator(rate=0.2, threshold=1.2), RateEscalator(rate=0.2, threshold=1.2)
    signals, decisions = [], []
    with no_eos(model):
        for seed in range(30):
            out = generate(model, tok, **ask, budget=0.25, calibration=None, max_new_tokens=4, escalate=esc, seed=seed)
            signals.append(out.escalator["value"])
            decisions.append(bool(out.escalations))
            assert all(t.budget == 1.0 for t in out.steps) == decisions[-1]
    assert decisions == [replay.decide(s) for s in signals] and len(set(signals)) > 20
    assert esc.seen == 30 and esc.escalated == sum(decisions) and 0.1 <= sum(decisions) / 30 <= 0.35
    assert (
        out.summary()
        .split("\n")[1]
        .endswith(f"escalated {sum(decisions)} of 30 answers ({sum(decisions) / 30:.0%}), target 20%")
    )


def test_calibrate_with_draws_fits_agreement_thresholds_per_budget(tmp_path, monkeypatch, capsys, tiny_smol):
    """`kvcert calibrate --draws 2`: the file records the draws and holds agreement thresholds per budget equal to
    numpy quantiles of the calibration half's collected disagreements; `kvcert generate` takes them with the same
    draws and refuses other draws in one line."""
    from kvcert.analysis.coverage import split_examples
    from kvcert.serve.calibration import DEFAULT_RATES

    model, tok = tiny_smol
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    out, work = tmp_path / "cal.json", tmp_path / "work"
    args = ["calibrate", "--model", "smollm2", "--tasks", "single_needle", "--lengths", "200", "--n", "4",
            "--budgets", "0.25,0.5", "--draws", "2", "--work-dir", str(work), "--out", str(out)]  # fmt: skip
    with no_eos(model):
        assert main(args) == 0
    assert "agreement thresholds (2 independent draws" in capsys.readouterr().out
    cal = Calibration.load(out)
    assert cal.draws == {"count": 2, "variant": "independent"}
    answers = pd.read_parquet(work / "answers.parquet")
    cal_ids, _ = split_examples(answers["example_id"].to_numpy(), 0)
    half = answers[answers["example_id"].isin(cal_ids)].dropna(subset=["disagreement"])
    assert len(half) >= 4
    for budget, group in half.groupby("budget"):
        values = group["disagreement"].to_numpy()
        want = {f"{r:g}": float(np.quantile(values, 1 - r)) for r in DEFAULT_RATES}
        assert cal.signal_budget_thresholds["agreement"][f"{budget:g}"] == pytest.approx(want, rel=1e-12)
    pooled = {f"{r:g}": float(np.quantile(half["disagreement"], 1 - r)) for r in DEFAULT_RATES}
    assert cal.signal_thresholds["agreement"] == pytest.approx(pooled, rel=1e-12)
    doc = tmp_path / "doc.txt"
    doc.write_text(make_examples("single_needle", 1, 200, tok, seed=7016)[0].context)
    gen = [
        "generate",
        "--model",
        "smollm2",
        "--context-file",
        str(doc),
        "--question",
        "What is the number?",
        "--calibration",
        str(out),
        "--max-new-tokens",
        "4",
        "--escalate",
        "0.2",
        "--escalate-signal",
        "agreement",
    ]
    with no_eos(model):
        assert main([*gen, "--draws", "2"]) == 0
        assert "draws: 2 independent, disagreement" in capsys.readouterr().out
        assert main([*gen, "--draws", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fitted with 2 independent draws, the request has 3 independent" in err[0]


def test_the_command_line_reports_the_draws_in_the_summary_json_and_html(tmp_path, monkeypatch, capsys, tiny_smol):
    model, tok = tiny_smol
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    doc = tmp_path / "doc.txt"
    ask = _ask(tok, seed=7017)
    doc.write_text(ask["context"])
    out_json, out_html = tmp_path / "a.json", tmp_path / "a.html"
    args = ["generate", "--model", SMOL, "--context-file", str(doc), "--question", ask["question"], "--budget",
            "0.25", "--max-new-tokens", "4", "--calibration", "none", "--draws-variant", "split",
            "--json", str(out_json), "--html", str(out_html)]  # fmt: skip
    with no_eos(model):
        assert main(args) == 0
    printed = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["draws"] == {"count": 2, "variant": "split"} and len(data["agreement"]["logprobs"]) == 2
    assert data["agreement"]["disagreement"] >= 0 and "draws: split halves of one draw" in data["summary"]
    assert data["summary"] in printed and isinstance(data["confidence"], float)
    page = out_html.read_text()
    assert "draws: split halves of one draw, disagreement" in page and "half 0: largest drop" in page
    assert "half 1: largest drop" in page


@pytest.mark.parametrize(
    ("extra", "phrase"),
    [
        (["--draws", "1"], "--draws 1: agreement needs a whole number of draws, at least 2"),
        (["--draws", "two"], "--draws two: agreement needs a whole number of draws"),
        (["--draws", "3", "--draws-variant", "split"], "the split halves are 2 rows; pass --draws 2"),
        (["--escalate", "0.2", "--escalate-signal", "agreement"], "needs several draws; pass --draws 2"),
        (["--escalate-signal", "agreement", "--draws", "2"], "needs a rate; pass --escalate 0.2"),
        (["--escalate", "0.2", "--escalate-signal", "agreement", "--draws", "2", "--escalate-scope", "token"],
         "pass --escalate-scope answer"),
    ],
)  # fmt: skip
def test_bad_draws_arguments_are_one_error_line(tmp_path, capsys, monkeypatch, extra, phrase):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvcert.serve, "load_model", refuse)
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.")
    args = ["generate", "--model", SMOL, "--context-file", str(doc), "--question", "Why?", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and phrase in err[0]


def test_help_names_the_draws_options_with_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--draws N" in text and "(default: one draw)" in text and "(default: independent)" in text
    assert "--escalate-signal {certificate,agreement}" in text and "(default certificate)" in text
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    assert "--draws N" in capsys.readouterr().out
