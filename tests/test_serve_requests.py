"""What a user meets serving a prompt: one validation for the API and the command line (the same words, each naming
the fix), the summary and the page saying which cache the answer came from, the HTML legend's scale at the threshold
the escalation used (the budget's), a default answer prefix that makes a base model answer, and a one-line warning
for an empty answer."""

from __future__ import annotations

import json
import random
import re
import warnings
from dataclasses import replace

import pytest

import kvcert.hf.decode
import kvcert.serve
from kvcert import Calibration, generate
from kvcert.bench.common import no_eos
from kvcert.serve.calibration import POLICY_FIELDS
from kvcert.serve.cli import main
from kvcert.serve.generate import STUDY4_ESCALATION, default_policy
from kvcert.serve.html import render_html
from kvcert.serve.validate import validate_request
from kvcert.tasks import make_examples

SMOL = "smollm2-135m-instruct"
QUESTION = "Who wrote the report?"
LEGEND = re.compile(r"certificate 0 &rarr; ([0-9.e+-]+) \(")


def _binary_text() -> str:
    """Bytes of a binary file read as UTF-8 text (what is not UTF-8 dropped): valid text, with control characters and
    unassigned code points the tokenizer drops. No carriage returns: reading the file would turn them into newlines."""
    rng = random.Random(0)
    raw = bytes(rng.randrange(256) for _ in range(3000)).decode("utf-8", errors="ignore")
    return "The report was written by Ada. " + raw.replace("\r", "")


def _calibration(model, name: str = SMOL, **overrides) -> Calibration:
    n = model.config.num_hidden_layers
    fields = {k: getattr(default_policy(0.25), k) for k in POLICY_FIELDS}
    args = dict(model=name, n_layers=n, policy=fields, budgets=[0.25, 0.5], multipliers=[1.5] * n)
    return Calibration(**{**args, **overrides})


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0].removeprefix("error: ")


# ----------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "context, question, budget, words",
    [
        ("", QUESTION, 0.25, "the context is empty; pass the document the question is about"),
        ("The report was written by Ada.", "", 0.25, "the question is empty; pass the question to answer"),
        ("The report was written by Ada.", "  \n\t", 0.25, "the question is empty; pass the question to answer"),
        ("The report was written by Ada.", QUESTION, 1.5, "the budget 1.5 is outside (0, 1]; pass the share"),
        ("The report was written by Ada.", QUESTION, 0.0, "the budget 0 is outside (0, 1]; pass the share"),
        ("The report was written by Ada.", QUESTION, "a quarter", "the budget 'a quarter' is not a number; pass"),
        (_binary_text(), QUESTION, 0.25, "the context does not round-trip through the tokenizer: it drops or changes"),
    ],
    ids=["empty-context", "empty-question", "blank-question", "budget-1.5", "budget-0", "budget-text", "binary"],
)
def test_the_api_and_the_command_line_refuse_a_bad_request_in_the_same_words(
    context, question, budget, words, tmp_path, monkeypatch, capsys, tiny_smol
):
    model, tok = tiny_smol
    with pytest.raises(ValueError) as refused:
        generate(model, tok, context=context, question=question, budget=budget, calibration=None, max_new_tokens=2)
    message = str(refused.value)
    assert message.startswith(words), message
    assert "; " in message and "example prompt" not in message  # the problem, then the fix
    if "round-trip" in words:  # names the characters and what to do
        assert "U+" in message and "strip control characters" in message and "pass plain text" in message
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    doc = tmp_path / "doc.txt"
    doc.write_text(context, encoding="utf-8")
    args = ["generate", "--model", SMOL, "--context-file", str(doc), "--question", question, "--budget", str(budget),
            "--max-new-tokens", "2", "--calibration", "none"]  # fmt: skip
    assert main(args) == 2
    assert _one_error_line(capsys) == " ".join(message.split())


def test_validate_request_checks_the_rest_and_passes_a_good_request(smol_tokenizer):
    ok = dict(context="The report was written by Ada.", question=QUESTION, budget=0.25, max_new_tokens=8)
    validate_request(**ok, tokenizer=smol_tokenizer)
    validate_request(messages=[{"role": "user", "content": "hi"}], context=None, question=None)
    for bad, words in (
        (dict(max_new_tokens=0), "max_new_tokens 0 is below 1; pass"),
        (dict(max_new_tokens=2.5), "max_new_tokens 2.5 is not a whole number; pass"),
        (dict(budget=True), "the budget True is not a number"),
        (dict(budget=float("nan")), "the budget nan is outside (0, 1]"),
        (dict(context=b"The report"), "the context is bytes, not text; pass the document"),
        (dict(answer_prefix=3), "the answer prefix is int, not text"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            validate_request(**{**ok, **bad})


# ----------------------------------------------------------------------------------------- what the answer came from
def test_the_summary_and_the_page_say_first_which_cache_the_answer_came_from(tiny_smol):
    """Restarted: "answer from the full cache (restarted from budget 0.25: <the certificate that crossed>)", then the
    full cache's exact certificates; kept: "answer from <policy> @ 0.25", its certificate and the threshold it stayed
    under. The page's title says the same, and its legend's scale is the threshold the escalation used: the file's
    table for the budget (0.25), not the pooled one."""
    model, tok = tiny_smol
    ex = make_examples("single_needle", 1, 300, tok, seed=7011)[0]
    pooled = {"0.2": 0.827}
    low = _calibration(model, "tiny", thresholds=pooled, budget_thresholds={"0.25": {"0.2": 0.000123}})
    high = replace(low, budget_thresholds={"0.25": {"0.2": 1e9}})
    kw = dict(context=ex.context, question=ex.question, budget=0.25, model_name="tiny", max_new_tokens=6)
    with no_eos(model):
        restarted = generate(model, tok, calibration=low, escalate="study4", **kw)
        kept = generate(model, tok, calibration=high, escalate="study4", **kw)
    (esc,) = restarted.escalations
    assert esc.threshold == restarted.threshold == 0.000123 and esc.scope == "answer"
    line = restarted.summary().split("\n")[1]
    assert line.startswith(f"answer from the full cache (restarted from budget 0.25: {esc.reason}): "), line
    assert esc.reason.startswith("the answer's largest certificate ") and esc.reason.endswith("> threshold 0.000123")
    assert "certificate 0 (full cache: exact)" in line and "trusted" not in line
    assert restarted.summary().endswith("the answer was redone with the full cache, so it is exact")
    assert "the discarded cache's prefill probe error" in line
    assert all(t.budget == 1.0 for t in restarted.steps)
    line = kept.summary().split("\n")[1]
    assert line.startswith("answer from window_question x randomized @ 0.25: largest token certificate "), line
    assert (
        "95% relative error radius, max over layers)" in line and "not escalated (certificate threshold 1e+09)" in line
    )
    assert kept.escalations == [] and "prefill probe error" in line and "discarded" not in line
    page = render_html(restarted)
    assert "<title>kvcert generate: answer from the full cache (restarted from budget 0.25: " in page
    assert LEGEND.findall(page) == ["0.000123"]  # the budget's threshold, the one in the escalation's reason
    assert "escalating 0.2 of answers at budget 0.25" in page and "0.827" not in page
    assert "<title>kvcert generate: answer from window_question x randomized @ 0.25</title>" in render_html(kept)


def test_the_commands_legend_threshold_is_the_escalations(tmp_path, monkeypatch, capsys, tiny_smol):
    """`kvcert generate --budget 0.25 --html`: the threshold printed at the restart, the JSON's and the legend's are
    one number, the calibration file's for budget 0.25 (its pooled threshold appears nowhere)."""
    model, tok = tiny_smol
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    cal = _calibration(model, thresholds={"0.2": 0.827}, budget_thresholds={"0.25": {"0.2": 0.000123}})
    path = cal.save(tmp_path / "cal.json")
    doc = tmp_path / "doc.txt"
    ex = make_examples("single_needle", 1, 300, tok, seed=7012)[0]
    doc.write_text(ex.context)
    out_json, out_html = tmp_path / "a.json", tmp_path / "a.html"
    args = ["generate", "--model", SMOL, "--context-file", str(doc), "--question", ex.question, "--budget", "0.25",
            "--max-new-tokens", "4", "--calibration", str(path), "--json", str(out_json),
            "--html", str(out_html), "--escalate", "study4"]  # fmt: skip
    with no_eos(model):
        assert main(args) == 0
    out = capsys.readouterr().out
    printed = re.search(
        r"\[restarted with the full cache: the answer's largest certificate \S+ > threshold (\S+)\]", out
    )
    data = json.loads(out_json.read_text())
    page = out_html.read_text()
    assert printed and printed.group(1) == "0.000123" and data["threshold"] == 0.000123
    assert data["escalation"]["rate"] == STUDY4_ESCALATION.rate and data["escalations"][0]["threshold"] == 0.000123
    assert LEGEND.findall(page) == [printed.group(1)] and "0.827" not in page
    assert data["summary"].split("\n")[1].startswith("answer from the full cache (restarted from budget 0.25: ")
    assert f"<title>kvcert generate: {SMOL}, answer from the full cache" in page


# ----------------------------------------------------------------------------------------------- the answer prefix
def test_the_answer_prefix_defaults_to_answer_for_a_model_without_a_chat_template(tiny_smol):
    """prompt_format plain (a base model's): answer_prefix=None reads "Answer:" after the question, as the tasks'
    base-model rendering puts a prefix; "" reads none; the chat format gets none by default."""
    from kvcert.serve.generate import build_prompt

    model, tok = tiny_smol
    kw = dict(context="The report was written by Ada.", question=QUESTION, messages=None)
    auto, _, _ = build_prompt(tok, **kw, prompt_format="plain")
    given, _, _ = build_prompt(tok, **kw, prompt_format="plain", answer_prefix="Answer:")
    none, _, _ = build_prompt(tok, **kw, prompt_format="plain", answer_prefix="")
    chat, _, _ = build_prompt(tok, **kw, prompt_format="chat")
    assert auto == given != none and tok.decode(auto).endswith(QUESTION + " Answer:")
    assert chat == build_prompt(tok, **kw, prompt_format="chat", answer_prefix="")[0]
    with no_eos(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no calibration"
        out = generate(model, tok, **{k: v for k, v in kw.items() if k != "messages"}, prompt_format="plain",
                       calibration=None, max_new_tokens=2)  # fmt: skip
    assert out.answer_prefix == "Answer:"


def test_an_empty_answer_is_one_warning_naming_answer_prefix(tmp_path, monkeypatch, capsys, tiny_smol):
    model, tok = tiny_smol
    monkeypatch.setattr(kvcert.hf.decode, "answer_length", lambda tokenizer, tokens, eos, stops: (0, ""))
    kw = dict(context="The report was written by Ada.", question=QUESTION, calibration=None, max_new_tokens=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(model, tok, **kw)
    assert out.text == ""
    (empty,) = [w for w in caught if "answer is empty" in str(w.message)]
    assert "answer_prefix='Answer:'" in str(empty.message) and "--answer-prefix" in str(empty.message)
    assert "\n" not in str(empty.message)
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    doc = tmp_path / "doc.txt"
    doc.write_text("The report was written by Ada.")
    args = ["generate", "--model", SMOL, "--context-file", str(doc), "--question", QUESTION, "--calibration", "none",
            "--max-new-tokens", "2"]  # fmt: skip
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "answer is empty" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: kvcert: the answer is empty")


@pytest.mark.slow
def test_the_packaged_gemma3_answers_a_retrieval_prompt_by_default():
    """The packaged Gemma 3 is a base model (no chat template): with the default answer prefix it answers a short
    needle-in-context question (without one it wrote nothing)."""
    model, tok = kvcert.serve.load_model("gemma3")
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    context = filler * 10 + "The secret code is 4172. " + filler * 10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(model, tok, context=context, question="What is the secret code?", budget=0.5)
    assert out.text.strip() and "4172" in out.text and out.answer_prefix == "Answer:"
    assert not [w for w in caught if "answer is empty" in str(w.message)]
