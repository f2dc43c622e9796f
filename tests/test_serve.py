"""Certified generation (kvcert.serve): the API's certificate is the runner's statistics, the calibration reaches its
nominal held-out coverage on synthetic attention, escalation to the full cache continues as full-cache greedy, and
a calibration that does not apply is refused or announced."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import hf_greedy
from kvcert import Calibration, CalibrationError, Escalation, Policy, generate
from kvcert.bench.common import no_eos
from kvcert.core.certificate import tight_radius
from kvcert.core.simulate import monte_carlo, random_problem
from kvcert.hf import FULL, DecodeOptions, Prompt, generate_variants
from kvcert.serve import calibration as calibration_module
from kvcert.serve.certificate import token_certificate
from kvcert.serve.generate import build_prompt, default_policy
from kvcert.tasks import make_examples


def _example(tokenizer, seed: int = 7001):
    return make_examples("single_needle", 1, 300, tokenizer, seed=seed)[0]


def _calibration(hf_model, policy: Policy, **overrides) -> Calibration:
    n = hf_model.config.num_hidden_layers
    fields = {k: getattr(policy, k) for k in calibration_module.POLICY_FIELDS}
    args = dict(model="tiny", n_layers=n, policy=fields, budgets=[0.25, 0.5], multipliers=[1.5] * n)
    return Calibration(**{**args, **overrides}, thresholds={"0.1": 0.2})


def test_token_certificate_is_the_calibrated_relative_radius_reduced_over_layers_and_heads():
    """Against a float64 recomputation: m_layer * r_tight / ||o_hat||, the max (or mean) over the defined cells;
    a layer kept exactly (NaN) is left out and reported as NaN."""
    g = torch.Generator().manual_seed(0)
    layers, heads = 3, 4
    variance = torch.rand(layers, heads, generator=g, dtype=torch.float64) * 0.1
    trace_c2 = variance.square() * (0.2 + torch.rand(layers, heads, generator=g, dtype=torch.float64))
    out_norm = 1 + torch.rand(layers, heads, generator=g, dtype=torch.float64)
    variance[1] = float("nan")  # a layer kept exactly
    m = torch.tensor([1.2, float("nan"), 0.8], dtype=torch.float64)
    stats = {"variance": variance, "trace_c2": trace_c2, "out_norm": out_norm}
    value, per_layer = token_certificate(stats, m, "max")
    expected = np.full((layers, heads), np.nan)
    for layer in (0, 2):
        for h in range(heads):
            r = tight_radius(variance[layer, h : h + 1], trace_c2[layer, h : h + 1], 0.95)[0]
            expected[layer, h] = float(m[layer] * r / out_norm[layer, h])
    assert float(value) == pytest.approx(np.nanmax(expected), rel=1e-12)
    assert np.allclose(per_layer.numpy()[[0, 2]], np.nanmax(expected[[0, 2]], 1))
    assert math.isnan(float(per_layer[1]))
    mean, _ = token_certificate(stats, m, "mean")
    assert float(mean) == pytest.approx(np.nanmean(expected), rel=1e-12)
    with pytest.raises(ValueError, match="reduction"):
        token_certificate(stats, m, "median")


def test_the_api_certificate_equals_the_runner_statistics(tiny_smol):
    """generate() and generate_variants (the runner's path) on the same prompt, policy and draws: the same tokens,
    and each token's certificate is the reduction of the runner's statistics of the step that predicted it."""
    model, tok = tiny_smol
    ex = _example(tok)
    policy = default_policy(0.25)
    cal = _calibration(model, policy, model="tiny")
    with no_eos(model):
        out = generate(model, tok, context=ex.context, question=ex.question, policy=policy, calibration=cal,
                       escalate=None, model_name="tiny", max_new_tokens=8, seed=3)  # fmt: skip
        ids, qs, stops = build_prompt(
            tok, context=ex.context, question=ex.question, messages=None, prompt_format="auto"
        )
        opts = DecodeOptions(max_new_tokens=8, stop_strings=tuple(stops), oracle=False)
        (ref,) = generate_variants(model, tok, Prompt(input_ids=ids, question_start=qs, example_id="kvcert-generate-3"),
                                   [policy], opts)  # fmt: skip
    assert out.tokens == ref.tokens[: len(out.tokens)] and len(out.tokens) >= 4
    assert out.certificate[0] == 0.0 and out.trusted[0]  # read exactly, before compression
    m = cal.multiplier_tensor()
    for i in range(1, len(out.tokens)):
        step = {k: torch.from_numpy(ref.stats[k][i - 1]).double() for k in ("variance", "trace_c2", "out_norm")}
        value, per_layer = token_certificate(step, m, cal.reduction)
        assert out.certificate[i] == pytest.approx(float(value), rel=1e-6), i
        assert np.allclose(out.steps[i].layers, per_layer.numpy(), rtol=1e-6, equal_nan=True)
        assert out.trusted[i] and out.steps[i].budget == 0.25
    assert np.allclose(out.logprobs, ref.logprobs[: len(out.tokens)], atol=1e-6)
    assert 0 < out.kv_bytes < out.full_kv_bytes


def test_escalation_to_the_full_cache_continues_as_full_cache_greedy(tiny_smol):
    """A threshold every compressed token exceeds escalates at token 1: the prompt and token 0 are re-read with the
    full cache, and from there the tokens are those of plain transformers greedy on that prefix."""
    model, tok = tiny_smol
    ex = _example(tok, seed=7002)
    streamed = []
    with no_eos(model):
        out = generate(model, tok, context=ex.context, question=ex.question, budget=0.25, calibration=None,
                       escalate=Escalation(threshold=-1.0, scope="token"), max_new_tokens=8,
                       on_token=streamed.append)  # fmt: skip
    assert len(out.escalations) == 1
    esc = out.escalations[0]
    assert (esc.token, esc.budget_from, esc.budget_to) == (1, 0.25, 1.0)
    ids, _, _ = build_prompt(tok, context=ex.context, question=ex.question, messages=None, prompt_format="auto")
    assert esc.reread_tokens == len(ids) + 1
    ref, _ = hf_greedy(model, ids + out.tokens[:1], 7)
    assert out.tokens[1:] == ref[: len(out.tokens) - 1]
    assert all(c == 0.0 for c in out.certificate[1:]) and all(out.trusted)  # the full cache: exact
    # the escalated token was never streamed; the token that ended the answer (EOS, stop string) was
    assert [t.id for t in streamed][: len(out.tokens)] == out.tokens and len(streamed) <= len(out.tokens) + 1
    assert out.kv_bytes >= out.full_kv_bytes * 0.9  # the full cache was held after the escalation


def test_answer_scope_escalation_restarts_the_answer_as_full_cache_greedy(tiny_smol):
    """scope="answer": when the answer's running certificate crosses, everything written is discarded and the answer
    restarts from the prompt with the full cache, so the final answer is plain transformers greedy on the prompt;
    the stream sees the restart as an Escalated event; a random answer-level control restarts before decoding."""
    from kvcert.serve.generate import Escalated

    model, tok = tiny_smol
    ex = _example(tok, seed=7004)
    events = []
    with no_eos(model):
        out = generate(model, tok, context=ex.context, question=ex.question, budget=0.25, calibration=None,
                       escalate=Escalation(threshold=-1.0, scope="answer"), max_new_tokens=8,
                       on_token=events.append)  # fmt: skip
    ids, _, _ = build_prompt(tok, context=ex.context, question=ex.question, messages=None, prompt_format="auto")
    ref, ref_logprobs = hf_greedy(model, ids, 8)
    assert out.tokens == ref[: len(out.tokens)] and len(out.tokens) == 8
    assert np.allclose(out.logprobs, ref_logprobs[: len(out.tokens)], atol=1e-4)
    (esc,) = out.escalations
    assert (esc.token, esc.scope, esc.discarded, esc.reread_tokens) == (0, "answer", 1, len(ids))
    assert all(c == 0.0 for c in out.certificate) and all(t.budget == 1.0 for t in out.steps)
    restart = [i for i, e in enumerate(events) if isinstance(e, Escalated)]
    assert restart == [1] and [e.id for e in events[2:]] == out.tokens  # one token streamed, void, then the answer
    with no_eos(model):
        never = generate(model, tok, context=ex.context, question=ex.question, budget=0.25, calibration=None,
                         escalate=Escalation(threshold=1e9, scope="answer"), max_new_tokens=8)  # fmt: skip
        coin = Escalation(signal="random", threshold=1.0, scope="answer")
        drawn = generate(model, tok, context=ex.context, question=ex.question, budget=0.25, calibration=None,
                         escalate=coin, max_new_tokens=8)  # fmt: skip
    assert not never.escalations and never.steps[-1].budget == 0.25
    assert drawn.tokens == out.tokens and drawn.escalations[0].reread_tokens == 0  # no compressed read was wasted
    with pytest.raises(ValueError, match="scope"):
        Escalation(threshold=1.0, scope="sentence")


def test_no_escalation_by_default_and_study4_is_study_4s_answer_level_certificate_rule(tiny_smol):
    """The default (study 5's pre-registered product rule) escalates nothing, even with a threshold every answer
    crosses. escalate="study4" is STUDY4_ESCALATION where a calibration gives its threshold: an answer whose largest
    certificate crosses the 20%-rate threshold is restarted with the full cache (= plain transformers greedy on the
    prompt); under it nothing changes (= escalate=None); without a calibration, or for the full cache, it does
    nothing. "auto" (the old default's name) is the same rule, with a FutureWarning naming "study4"."""
    from dataclasses import replace

    from kvcert.serve.generate import DEFAULT_ESCALATION, STUDY4_ESCALATION

    assert STUDY4_ESCALATION == DEFAULT_ESCALATION == Escalation()
    assert Escalation(scope="answer", signal="certificate", rate=0.2, budget=1.0) == STUDY4_ESCALATION
    model, tok = tiny_smol
    ex = _example(tok, seed=7008)
    policy = default_policy(0.25)
    base = _calibration(model, policy)
    low, high = replace(base, thresholds={"0.1": 1e9, "0.2": -1.0}), replace(base, thresholds={"0.2": 1e9})
    kw = dict(context=ex.context, question=ex.question, policy=policy, model_name="tiny", max_new_tokens=6)
    with no_eos(model):
        default = generate(model, tok, calibration=low, **kw)
        restarted = generate(model, tok, calibration=low, escalate="study4", **kw)
        with pytest.warns(FutureWarning, match="escalate='study4'"):
            renamed = generate(model, tok, calibration=low, escalate="auto", **kw)
        kept = generate(model, tok, calibration=high, escalate="study4", **kw)
        off = generate(model, tok, calibration=high, escalate=None, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no calibration"
            uncalibrated = generate(model, tok, calibration=None, escalate="study4", **kw)
        full = generate(model, tok, **{**kw, "policy": FULL, "escalate": "study4"})
    ids, _, _ = build_prompt(tok, context=ex.context, question=ex.question, messages=None, prompt_format="auto")
    ref, _ = hf_greedy(model, ids, 6)
    assert default.escalations == [] and default.escalation is None and default.tokens == off.tokens
    (esc,) = restarted.escalations
    assert (esc.token, esc.budget_to) == (0, 1.0) and "certificate" in esc.reason  # the rate-0.2 threshold, not 0.1's
    assert restarted.tokens == ref and restarted.kv_bytes == restarted.full_kv_bytes
    assert renamed.tokens == restarted.tokens and len(renamed.escalations) == 1
    assert kept.escalations == [] and kept.tokens == off.tokens and kept.certificate == off.certificate
    assert uncalibrated.escalations == [] and full.escalations == [] and full.tokens == ref
    with pytest.raises(ValueError, match="pass None, 'study4', an Escalation or a RateEscalator"):
        generate(model, tok, calibration=high, escalate="always", **kw)


def test_tolerance_picks_the_smallest_rung_whose_probe_error_is_within_it(tiny_smol, monkeypatch):
    """tolerance=t: the probe errors reported per rung are the probes compress_while_reading measures for each rung
    on its own; the chosen budget is the smallest within t, and the answer (and the KV held) is generate's at that
    budget, from ONE read of the prompt; a tolerance no rung meets takes the full cache (plain greedy, a second read);
    a probe signal escalates before the first token."""
    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading, serving_prefill
    from kvcert.serve.probe import probe_error

    model, tok = tiny_smol
    ex = _example(tok, seed=7005)
    ids, qs, _ = build_prompt(tok, context=ex.context, question=ex.question, messages=None, prompt_format="auto")
    prompt = Prompt(input_ids=ids, question_start=qs, example_id="kvcert-generate-0")
    errors = {}
    for b in (0.125, 0.25, 0.5):
        batch = compress_while_reading(model, prompt, [default_policy(b)], DecodeOptions(oracle=False), probe=True)
        errors[b] = probe_error(batch.probes[0])
    assert all(0 < e < 10 for e in errors.values())
    middle = sorted(errors.values())[1]
    kw = dict(context=ex.context, question=ex.question, calibration=None, model_name="tiny-tol", max_new_tokens=6)
    reads = []
    read = serving_prefill._read
    monkeypatch.setattr(serving_prefill, "_read", lambda *a, **k: reads.append(1) or read(*a, **k))
    with no_eos(model):
        out = generate(model, tok, tolerance=middle, **kw)
        assert len(reads) == 1, "tolerance= must read the prompt once when a rung is chosen"
        expected = min(b for b, e in errors.items() if e <= middle)
        assert out.budget_choice.chosen == expected and out.policy.budget == expected
        assert out.budget_choice.errors == {f"{b:g}": pytest.approx(e, rel=1e-6) for b, e in errors.items()}
        assert out.budget_choice.extra_prefill_tokens == 0
        same = generate(model, tok, budget=expected, **kw)
        assert out.tokens == same.tokens and out.probe.error == pytest.approx(errors[expected], rel=1e-6)
        assert out.kv_bytes == same.kv_bytes
        reads.clear()
        strict = generate(model, tok, tolerance=min(errors.values()) / 2, **kw)
        assert len(reads) == 2 and strict.budget_choice.extra_prefill_tokens == len(ids)
        early = generate(model, tok, budget=0.25, escalate=Escalation(signal="probe", threshold=0.0, scope="answer"),
                         **kw)  # fmt: skip
    ref, _ = hf_greedy(model, ids, 6)
    assert strict.budget_choice.chosen == 1.0 and strict.tokens == ref and strict.probe is None
    assert early.tokens == ref and early.escalations[0].discarded == 0 and "probe error" in early.escalations[0].reason
    with pytest.raises(ValueError, match="tolerance"):
        generate(model, tok, tolerance=-1.0, **kw)


def test_the_full_cache_needs_no_calibration_and_holds_exactly_the_full_cache(tiny_smol):
    """policy=FULL: no "no calibration" warning, every certificate exactly 0 and every token trusted, and kv_bytes
    equals full_kv_bytes, counted independently here from the model's shape (every layer: prompt + max_new_tokens
    + the one reserved slot); a compressed cache of the same prompt holds less."""
    from kvcert.policy import FULL

    model, tok = tiny_smol
    ex = _example(tok, seed=7003)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with no_eos(model):
            out = generate(model, tok, context=ex.context, question=ex.question, policy=FULL,
                           model_name="tiny-full", max_new_tokens=6)  # fmt: skip
    assert not [w for w in caught if "calibration" in str(w.message)]
    assert all(out.trusted) and all(c == 0.0 for c in out.certificate) and len(out.tokens) == 6
    assert out.calibration is not None and "(uncalibrated)" not in out.summary()
    cfg = model.config
    slot = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # float32 K and V
    assert out.kv_bytes == out.full_kv_bytes == slot * cfg.num_hidden_layers * (out.prompt_tokens + 6 + 1)
    with no_eos(model):
        kept = generate(model, tok, context=ex.context, question=ex.question, budget=0.25, calibration=None,
                        model_name="tiny-full", max_new_tokens=6)  # fmt: skip
    assert kept.full_kv_bytes == out.full_kv_bytes and kept.kv_bytes < out.kv_bytes


def test_a_calibration_that_does_not_apply_is_refused_and_none_is_announced_once(tiny_smol, tmp_path):
    model, tok = tiny_smol
    ex = _example(tok)
    policy = default_policy(0.25)
    other = _calibration(model, policy, model="another-model").save(tmp_path / "other.json")
    with pytest.raises(CalibrationError, match="another-model"):
        generate(model, tok, context=ex.context, question=ex.question, policy=policy, calibration=other,
                 model_name="tiny", max_new_tokens=2)  # fmt: skip
    narrow = _calibration(model, policy, model="tiny", budgets=[0.5])
    with pytest.raises(CalibrationError, match="budgets 0.5-0.5"):
        generate(model, tok, context=ex.context, question=ex.question, policy=policy, calibration=narrow,
                 model_name="tiny", max_new_tokens=2)  # fmt: skip
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CalibrationError, match="not JSON"):
        Calibration.load(tmp_path / "bad.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with no_eos(model):
            out = [
                generate(
                    model,
                    tok,
                    context=ex.context,
                    question=ex.question,
                    budget=0.25,
                    calibration=None,
                    model_name="tiny-uncalibrated",
                    max_new_tokens=4,
                )  # fmt: skip
                for _ in range(2)
            ]
    assert sum("no calibration" in str(w.message) for w in caught) == 1
    assert out[0].trusted == [True, False, False, False] and out[0].calibration is None  # only the exact token
    with pytest.raises(ValueError, match="window of"):
        generate(model, tok, context=ex.context * 20, question=ex.question, budget=0.25, calibration=None)
    with pytest.raises(ValueError, match="budget"):
        Policy(scorer="window_question", design="randomized", budget=1.5)


def test_calibration_reaches_nominal_held_out_coverage_on_synthetic_attention():
    """The S2 fit on Monte Carlo cells of the randomized design (kvcert.core.simulate, three attention regimes as
    three layers, design draws grouped into examples): the held-out coverage of m_layer * r_tight lies within the
    binomial interval around 0.95, each layer's too, and the thresholds escalate their share of answers."""
    rows = []
    regimes = [dict(peakedness=1.5, window_noise=0.3), dict(peakedness=2.0, window_noise=3.0), dict(peakedness=4.0)]
    for layer, kw in enumerate(regimes):
        g = torch.Generator().manual_seed(11 + layer)
        prob = random_problem(n=400, d=32, generator=g, **kw)
        r = monte_carlo(prob, budget=0.25, tail_fraction=0.75, floor=0.2, draws=1200, generator=g, moments=True)
        rows.append(
            pd.DataFrame(
                dict(
                    example_id=[f"e{i // 20}" for i in range(1200)],
                    step=[i % 20 for i in range(1200)],
                    layer=layer,
                    head=0,
                    error=r["sq_err"].sqrt().double().numpy(),
                    variance=r["variance"].double().numpy(),
                    trace_c2=r["trace_c2"].double().numpy(),
                    out_norm=float(r["exact_norm"]),
                    tail_mass=r["tail_mass"].double().numpy(),
                    budget=0.25,
                )
            )
        )
    exact = rows[0].assign(layer=3, variance=np.nan, trace_c2=np.nan)  # a layer kept exactly: no certificate
    cells = pd.concat([*rows, exact], ignore_index=True)
    ids = sorted(cells["example_id"].unique())
    answers = pd.DataFrame(
        dict(example_id=ids, budget=0.25, full_correct=True, correct=[i % 3 != 0 for i in range(60)])
    )
    res = calibration_module.fit(answers, cells, n_layers=4, rates=(0.2,))
    rep = res["report"]
    # 99% interval around the nominal level: the binomial spread of the held-out cells plus that of the fitted
    # quantile (the coverage given the calibration half is Beta with variance ~ level (1 - level) / n_cal)
    n_test, n_cal = rep["n_test_cells"], rep["n_cal_cells"]
    half = 2.58 * math.sqrt(0.95 * 0.05 * (1 / n_test + 1 / n_cal))
    assert abs(rep["coverage"] - 0.95) <= half, rep
    assert rep["worst_layer"]["coverage"] >= 0.95 - 2.58 * math.sqrt(0.95 * 0.05 * 3 * (1 / n_test + 1 / n_cal))
    assert all(m is not None and m > 0 for m in res["multipliers"][:3]) and res["multipliers"][3] is None
    assert res["reduction"] in ("max", "mean") and set(rep["auroc"]) == {"max", "mean"}
    assert rep["held_out_escalation_rate"]["0.2"] == pytest.approx(0.2, abs=0.2)


def test_chat_messages_work_and_their_last_tokens_play_the_question(tiny_smol):
    """messages= renders the model's chat template; a conversation has no context / question split, so the last
    MESSAGES_WINDOW tokens are the observation window and the rest is compressed (a certificate > 0)."""
    from kvcert.serve.generate import MESSAGES_WINDOW

    model, tok = tiny_smol
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The sky is blue. " * 40 + "What colour is the sky?"},
    ]
    ids, qs, stops = build_prompt(tok, context=None, question=None, messages=messages, prompt_format=None)
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert qs == len(ids) - MESSAGES_WINDOW and stops
    with no_eos(model):
        out = generate(model, tok, messages=messages, budget=0.5, calibration=None, max_new_tokens=4)
    assert out.prompt_tokens == len(ids) and max(out.certificate) > 0
    with pytest.raises(ValueError, match="either messages"):
        generate(model, tok, messages=messages, context="x", question="y")


@pytest.mark.slow
def test_calibrate_and_generate_on_the_packaged_model(tmp_path):
    """kvcert calibrate's library side on SmolLM2 (6 examples): a file that names the model, the policy, the budgets
    and the data, a multiplier per layer, held-out coverage in [0, 1]; generate() with it trusts its tokens, refuses
    it for another budget, and holds less KV than the full cache."""
    from kvcert.serve import load_model
    from kvcert.serve.calibration import calibrate, describe

    model, tok = load_model("smollm2")
    examples = [e for t in ("single_needle", "fact_qa") for e in make_examples(t, 3, 512, tok, seed=5900)]
    fields = {k: getattr(default_policy(0.25), k) for k in calibration_module.POLICY_FIELDS}
    cal = calibrate(model, tok, "smollm2-135m-instruct", examples, policy_fields=fields, budgets=[0.25, 0.5],
                    data={"tasks": ["single_needle", "fact_qa"]}, log=None)  # fmt: skip
    path = cal.save(tmp_path / "calib.json")
    loaded = Calibration.load(path)
    assert (loaded.model, loaded.n_layers, loaded.budgets) == ("smollm2-135m-instruct", 30, [0.25, 0.5])
    assert loaded.policy == fields and loaded.data["n_examples"] == 6
    assert all(m is not None and m > 0 for m in loaded.multipliers)
    assert 0.0 <= loaded.report["coverage"] <= 1.0 and "held-out coverage" in describe(loaded)
    ex = make_examples("single_needle", 1, 512, tok, seed=5950)[0]
    out = generate(model, tok, context=ex.context, question=ex.question, budget=0.3, calibration=path, max_new_tokens=8,
                   escalate=None)  # fmt: skip
    assert all(out.trusted) and out.calibration == "calib.json" and out.kv_bytes < 0.5 * out.full_kv_bytes
    with pytest.raises(CalibrationError, match="budgets"):
        generate(model, tok, context=ex.context, question=ex.question, budget=0.75, calibration=path)


def test_escalation_thresholds_are_the_budgets_own_when_the_file_has_them(tiny_smol):
    """A calibration with per-budget tables: the certificate threshold for a rate comes from the policy's budget
    (the pooled table otherwise), and study 4's rule (escalate="study4") acts on it."""
    from dataclasses import replace

    cal = Calibration(model="m", n_layers=2, policy={}, budgets=[0.25, 0.5], multipliers=[1.0, 1.0],
                      thresholds={"0.2": 9.0}, budget_thresholds={"0.25": {"0.1": 1.0, "0.2": 2.0}})  # fmt: skip
    assert cal.signal_threshold("certificate", 0.2, budget=0.25) == 2.0
    assert cal.signal_threshold("certificate", 0.15, budget=0.25) in (1.0, 2.0)  # the nearest fitted rate
    assert cal.signal_threshold("certificate", 0.2, budget=0.5) == 9.0 == cal.signal_threshold("certificate", 0.2)
    model, tok = tiny_smol
    ex = _example(tok, seed=7009)
    policy = default_policy(0.25)
    base = replace(_calibration(model, policy), thresholds={"0.2": 1e9})
    kw = dict(context=ex.context, question=ex.question, policy=policy, model_name="tiny", max_new_tokens=4)
    with no_eos(model):
        pooled = generate(model, tok, calibration=base, escalate="study4", **kw)
        own = generate(model, tok, calibration=replace(base, budget_thresholds={"0.25": {"0.2": -1.0}}),
                       escalate="study4", **kw)  # fmt: skip
        other = generate(model, tok, calibration=replace(base, budget_thresholds={"0.5": {"0.2": -1.0}}),
                         escalate="study4", **kw)  # fmt: skip
    assert pooled.escalations == [] and other.escalations == [] and len(own.escalations) == 1


def test_the_shipped_thresholds_per_budget_are_study_4s():
    """The packaged models' files hold, per budget, the 1 - rate quantile of the answer's largest certificate on study
    4's calibration split (recomputed here from the published records with pandas and numpy)."""
    import json
    from pathlib import Path

    from kvcert.serve.calibration import shipped
    from kvcert.studies.study4.claims import in_calibration_split

    for tag, name in (("smollm2", "smollm2-135m-instruct"), ("gemma3", "gemma3-270m")):
        lines = Path(f"results/study4/{tag}/answers.jsonl").read_text().splitlines()
        df = pd.DataFrame([json.loads(line) for line in lines])
        cal = shipped(name)
        assert set(cal.budget_thresholds) == {"0.5", "0.25", "0.125"} and "study 4" in cal.budget_thresholds_source
        for budget, table in cal.budget_thresholds.items():
            rows = df[df["example_id"].map(in_calibration_split) & np.isclose(df["budget"], float(budget))]
            scores = rows["certificate"].dropna().to_numpy(np.float64)
            for rate, threshold in table.items():
                assert threshold == pytest.approx(float(np.quantile(scores, 1 - float(rate))), rel=1e-12)
