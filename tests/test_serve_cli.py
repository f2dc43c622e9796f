"""The `kvcert` command line and the HTML view: bad input is one `error:` line and exit code 2 (before the model
loads where it can be), a run writes valid JSON (NaN -> null) and a self-contained page with one span per token,
escaped token text and the escalation marked where it happened."""

from __future__ import annotations

import json
import math
import re
import warnings
from html import escape
from html.parser import HTMLParser

import pytest

import kvcert.serve
from kvcert.bench.common import no_eos
from kvcert.policy import FULL
from kvcert.serve import Calibration, Escalation, generate
from kvcert.serve.calibration import POLICY_FIELDS, shipped
from kvcert.serve.cli import main
from kvcert.serve.generate import STUDY4_ESCALATION, Escalated, Generation, Token, default_policy
from kvcert.serve.html import render_html
from kvcert.tasks import make_examples

SMOL = "smollm2-135m-instruct"
TOKEN_SPAN = re.compile(r'<span class="tok[^"]*" id="t(\d+)"')


class _Tags(HTMLParser):
    """Every start tag with its attributes (to look for anything that would load from elsewhere)."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(page: str) -> list[tuple[str, dict]]:
    parser = _Tags()
    parser.feed(page)
    return parser.tags


def _assert_self_contained(page: str) -> None:
    assert "http://" not in page and "https://" not in page and "url(" not in page and "@import" not in page
    tags = _tags(page)
    assert not [t for t, _ in tags if t in ("script", "link", "img", "iframe", "object", "embed", "base")]
    assert not [a for _, attrs in tags for a in attrs if a in ("src", "href", "srcset")]


def _policy_fields() -> dict:
    return {k: getattr(default_policy(0.25), k) for k in POLICY_FIELDS}


def _calibration(model_name: str, n_layers: int, **overrides) -> Calibration:
    args = dict(model=model_name, n_layers=n_layers, policy=_policy_fields(), budgets=[0.25, 0.5])
    return Calibration(**{**args, "multipliers": [1.5] * n_layers, "thresholds": {"0.1": 0.2}, **overrides})


def _handmade_generation() -> Generation:
    """Three tokens, the third after an escalation to the full cache; token text that must be escaped."""
    nan = math.nan
    steps = [
        Token(0, 11, "<script>alert(1)</script>", -0.1, 0.0, True, [nan, nan], 0.25),
        Token(1, 12, ' "a" & b', -2.3, 0.31, False, [0.31, nan], 0.25),
        Token(2, 13, "</span><b>", -0.01, 0.0, True, [nan, nan], 1.0),
    ]
    esc = Escalated(
        token=2, reason="certificate 0.9 > threshold 0.5", budget_from=0.25, budget_to=1.0, reread_tokens=40
    )
    return Generation(
        text="".join(t.text for t in steps),
        steps=steps,
        escalations=[esc],
        kv_bytes=3 * 2**20,
        full_kv_bytes=8 * 2**20,
        prompt_tokens=37,
        policy=default_policy(0.25),
        calibration="tiny: given",
        reduction="max",
        stopped="max_new_tokens",
    )


# ----------------------------------------------------------------------------------------------- the HTML view
def test_the_page_is_self_contained_escapes_token_text_and_marks_the_escalation():
    gen = _handmade_generation()
    page = render_html(gen, title="t <i>", question="Why <b>?", threshold=0.5)
    _assert_self_contained(page)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "</span><b>" not in page and "&lt;/span&gt;&lt;b&gt;" in page
    assert "Why &lt;b&gt;?" in page and "<title>t &lt;i&gt;</title>" in page
    assert [int(i) for i in TOKEN_SPAN.findall(page)] == [0, 1, 2]  # one span per token, in order
    spans = {int(m.group(1)): m.group(0) for m in TOKEN_SPAN.finditer(page)}
    assert "untrusted" in spans[1] and "untrusted" not in spans[0]
    assert " full" in spans[2] and " exact" in spans[0]
    # the escalation sits right before the token produced after the re-read, its reason in the card
    marks = [m.start() for m in re.finditer(r'<mark class="esc" data-tip="', page)]
    assert len(marks) == 1 and page.index('id="t1"') < marks[0] < page.index('id="t2"')
    assert "certificate 0.9 &gt; threshold 0.5" in page and "re-read 40 tokens" in page
    # the hover card of the compressed token lists its compressed layer only, and its log-probability
    card = re.search(r'id="t1" data-tip="([^"]*)"', page).group(1)
    assert "L0: 0.31" in card and "L1:" not in card and "log-probability -2.300" in card
    assert "KV cache held 3.0 MiB vs 8.0 MiB for the full cache (38%)" in page
    assert escape(gen.summary()) in page


def test_the_page_of_a_real_generation_has_one_span_per_token_and_its_escalation(tiny_smol):
    model, tok = tiny_smol
    ex = make_examples("single_needle", 1, 300, tok, seed=7003)[0]
    with no_eos(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no calibration": this test is about the page
        out = generate(model, tok, context=ex.context, question=ex.question, budget=0.25, calibration=None,
                       escalate=Escalation(threshold=-1.0, scope="token"), max_new_tokens=6)  # fmt: skip
    assert len(out.escalations) == 1 and len(out.steps) >= 3
    page = render_html(out, question=ex.question)
    _assert_self_contained(page)
    assert [int(i) for i in TOKEN_SPAN.findall(page)] == list(range(len(out.steps)))
    at = out.escalations[0].token
    mark = page.index('<mark class="esc" data-tip="')
    assert page.index(f'id="t{at - 1}"') < mark < page.index(f'id="t{at}"')
    assert all(t.budget == FULL.budget for t in out.steps[at:])
    assert all(" full" in m.group(0) for m in TOKEN_SPAN.finditer(page) if int(m.group(1)) >= at)


# ----------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def no_model_load(monkeypatch):
    """Bad input found before the model loads: loading it fails the test."""

    def refuse(name, **kwargs):
        raise AssertionError(f"the model {name} was loaded before the input was checked")

    monkeypatch.setattr(kvcert.serve, "load_model", refuse)


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("The report was written by Ada in 1843. It describes the engine.\n")
    return path


def _generate_args(doc, *extra, model=SMOL) -> list[str]:
    return ["generate", "--model", model, "--context-file", str(doc), "--question", "Who wrote it?", *extra]


def _one_error_line(capsys, *phrases: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "extra, phrases",
    [
        (["--budget", "0"], ["the budget 0 is outside (0, 1]; pass"]),
        (["--budget", "1.5"], ["the budget 1.5 is outside (0, 1]"]),
        (["--budget", "a quarter"], ["is not a number"]),
        (["--max-new-tokens", "0"], ["max_new_tokens 0 is below 1; pass"]),
        (["--escalate", "2"], ["--escalate 2 is outside (0, 1); pass none, study4 or a rate"]),
        (["--escalate", "banana"], ["--escalate 'banana' is not a valid value; pass none, study4 or a rate in (0, 1)"]),
        (
            ["--escalate-signal", "agreement", "--draws", "2"],
            ["--escalate-signal agreement needs a rate; pass --escalate"],
        ),
        (["--calibration", "none", "--escalate", "0.1"], ["--escalate needs a calibration"]),
        (["--calibration", "no-such.json"], ["calibration file no-such.json does not exist; pass"]),
        (["--tolerance", "0"], ["--tolerance 0 is not positive"]),
        (["--tolerance", "tight"], ["--tolerance 'tight' is not a number"]),
        (["--tolerance", "0.1", "--ladder", "0.25,2"], ["--ladder 0.25,2: every budget must lie in (0, 1]"]),
    ],
)
def test_bad_arguments_are_one_error_line_before_the_model_loads(doc, extra, phrases, capsys, no_model_load):
    assert main(_generate_args(doc, *extra)) == 2
    _one_error_line(capsys, *phrases)


def test_a_missing_context_file_is_refused(tmp_path, capsys, no_model_load):
    assert main(_generate_args(tmp_path / "nope.txt")) == 2
    _one_error_line(capsys, "context file", "nope.txt does not exist")


def test_a_hub_id_goes_to_the_loader_and_its_refusal_is_one_line(doc, capsys, monkeypatch):
    """`--model gpt2` is not refused as unknown: the id reaches kvcert.load_model, whose ModelLoadError (offline: not
    in the local cache, run `hf download`) is the one error line; a short name reaches it as the packaged name."""
    from kvcert.hf.loading import ModelLoadError

    asked = []

    def offline(name, **kwargs):
        asked.append(name)
        raise ModelLoadError(f"model '{name}' is not in the local Hugging Face cache: run `hf download {name}`")

    monkeypatch.setattr(kvcert.serve, "load_model", offline)
    assert main(_generate_args(doc, "--calibration", "none", model="gpt2")) == 2
    _one_error_line(capsys, "model 'gpt2' is not in the local Hugging Face cache", "hf download gpt2")
    assert main(_generate_args(doc, "--calibration", "none", model="gemma3")) == 2
    _one_error_line(capsys, "gemma3-270m")
    assert asked == ["gpt2", "gemma3-270m"]


def test_help_names_every_generate_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for phrase in (
        "--question QUESTION the question to answer from the document",
        "the most tokens the answer may have (default 64)",
        "seed of the randomized design's draws (default 0)",
        "that crossed (default answer)",
        "--escalate {none,study4,RATE}",
        "(default none)",
        "(default 0.25)",
        "Hugging Face hub id",
        "'Answer:' for a model without a chat template",
    ):
        assert phrase in text, phrase


def test_a_folder_the_loader_cannot_read_is_its_one_line_error(doc, tmp_path, capsys):
    folder = tmp_path / "empty-model"
    folder.mkdir()
    assert main(_generate_args(doc, model=str(folder))) == 2
    _one_error_line(capsys, "empty-model", "could not be loaded")


def test_a_calibration_for_another_model_is_refused(doc, tmp_path, capsys, no_model_load):
    path = _calibration("other", 30, budgets=[0.25]).save(tmp_path / "other.json")
    assert main(_generate_args(doc, "--calibration", str(path))) == 2
    _one_error_line(capsys, "other.json does not apply", "'other'", "; run `kvcert calibrate")


def test_a_calibration_for_another_policy_is_refused(doc, tmp_path, capsys, no_model_load):
    path = _calibration(SMOL, 30, policy={**_policy_fields(), "floor": 0.5}).save(tmp_path / "floor.json")
    assert main(_generate_args(doc, "--calibration", str(path))) == 2
    _one_error_line(capsys, "floor.json does not apply", "policy")


def test_a_calibration_file_that_is_not_json_is_refused(doc, tmp_path, capsys, no_model_load):
    path = tmp_path / "broken.json"
    path.write_text("{multipliers: [1, 2")
    assert main(_generate_args(doc, "--calibration", str(path))) == 2
    _one_error_line(capsys, "broken.json is not JSON (", "; pass a file `kvcert calibrate")


def test_a_context_longer_than_the_window_is_refused(tmp_path, monkeypatch, capsys, smol_tokenizer):
    from kvcert.testing import tiny_random_model

    model, _ = tiny_random_model("llama", vocab_size=len(smol_tokenizer), max_position_embeddings=256)
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, smol_tokenizer))
    doc = tmp_path / "long.txt"
    doc.write_text(make_examples("single_needle", 1, 600, smol_tokenizer, seed=7004)[0].context)
    assert main(_generate_args(doc, "--calibration", "none")) == 2
    _one_error_line(capsys, "window of 256", "shorten the context")


@pytest.mark.parametrize(
    "extra, phrases",
    [
        (["--data", "missing.jsonl"], ["data file missing.jsonl does not exist"]),
        (["--tasks", "single_needle,haystack_soup"], ["unknown task(s) haystack_soup", "single_needle"]),
        (["--budgets", "0.25,2"], ["--budgets 2 is outside (0, 1]"]),
    ],
)
def test_calibrate_refuses_bad_input_before_the_model_loads(
    tmp_path, monkeypatch, extra, phrases, capsys, no_model_load
):
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--model", SMOL, *extra, "--out", str(tmp_path / "c.json")]) == 2
    _one_error_line(capsys, *phrases)
    assert not (tmp_path / "c.json").exists()


# ----------------------------------------------------------------------------------------------- a run
def test_generate_streams_the_tokens_and_writes_json_and_html(tmp_path, monkeypatch, capsys, tiny_smol):
    """The tiny model under the packaged name with a calibration file for it whose threshold every compressed
    token exceeds: --escalate 0.1 escalates at token 1; the JSON holds every token's certificate (NaN -> null)."""
    model, tok = tiny_smol
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    n = model.config.num_hidden_layers
    cal = _calibration(SMOL, n, thresholds={"0.1": 0.0}).save(tmp_path / "tiny.json")
    doc = tmp_path / "doc.txt"
    ex = make_examples("single_needle", 1, 300, tok, seed=7005)[0]
    doc.write_text(ex.context)
    out_json, out_html = tmp_path / "out" / "a.json", tmp_path / "a.html"
    args = ["generate", "--model", SMOL, "--context-file", str(doc), "--question", ex.question, "--budget", "0.25",
            "--max-new-tokens", "6", "--calibration", str(cal), "--escalate", "0.1", "--escalate-scope", "token",
            "--json", str(out_json), "--html", str(out_html)]  # fmt: skip
    with no_eos(model):
        assert main(args) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "error:" not in captured.err

    def no_nan(text):
        raise AssertionError(f"{text} in the JSON")

    data = json.loads(out_json.read_text(), parse_constant=no_nan)
    steps = data["steps"]
    streamed = "".join(s["text"] for s in steps)
    assert len(steps) == 6 and streamed.strip() == data["text"]
    assert all(isinstance(s["certificate"], float) for s in steps)  # one certificate per token
    assert steps[0]["certificate"] == 0.0 and steps[0]["layers"] == [None] * n  # read exactly: no layer values
    assert [e["token"] for e in data["escalations"]] == [1] and data["escalations"][0]["budget_to"] == 1.0
    assert data["policy"]["budget"] == 0.25 and data["calibration"] == "tiny.json"
    assert captured.out.startswith(streamed + "\n")  # streamed as the tokens came, then the answer and summary
    assert f"\n{data['summary']}\n" in captured.out and data["summary"].startswith(f"answer: {data['text'].strip()}\n")
    page = out_html.read_text()
    _assert_self_contained(page)
    assert len(TOKEN_SPAN.findall(page)) == 6 and page.count('<mark class="esc" data-tip="') == 1


def test_generate_with_a_tolerance_reports_the_budget_it_chose(tmp_path, monkeypatch, capsys, tiny_smol):
    """--tolerance: a tolerance every rung meets takes the smallest rung; the JSON holds the choice and the probe."""
    model, tok = tiny_smol
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    doc = tmp_path / "doc.txt"
    ex = make_examples("single_needle", 1, 300, tok, seed=7006)[0]
    doc.write_text(ex.context)
    out_json = tmp_path / "a.json"
    args = ["generate", "--model", SMOL, "--context-file", str(doc), "--question", ex.question, "--tolerance", "1e9",
            "--ladder", "0.25,0.5,1", "--max-new-tokens", "4", "--calibration", "none",
            "--json", str(out_json)]  # fmt: skip
    with no_eos(model):
        assert main(args) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["budget_choice"]["chosen"] == 0.25 and data["policy"]["budget"] == 0.25
    assert set(data["budget_choice"]["errors"]) == {"0.25", "0.5"} and data["probe"]["error"] > 0
    assert "budget from tolerance 1e+09: 0.25" in out


@pytest.mark.slow
def test_generate_end_to_end_on_the_packaged_smollm2(tmp_path, capsys):
    tok = kvcert.serve.load_model(SMOL)[1]
    ex = make_examples("single_needle", 1, 1024, tok, seed=7000)[0]
    doc = tmp_path / "doc.txt"
    doc.write_text(ex.context)
    out_json, out_html = tmp_path / "answer.json", tmp_path / "answer.html"
    args = ["generate", "--model", SMOL, "--context-file", str(doc), "--question", ex.question, "--budget", "0.25",
            "--max-new-tokens", "16", "--json", str(out_json), "--html", str(out_html)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["text"].strip() and f"answer: {data['text'].strip()}" in out and data["summary"] in out
    assert 1 <= len(data["steps"]) <= 16
    assert all(isinstance(s["certificate"], float) and s["trusted"] for s in data["steps"])  # shipped calibration
    assert data["calibration"] == f"{SMOL}: shipped"
    # no escalation by default (study 5): the answer is the compressed cache's, and the legend runs to its own top
    assert data["escalations"] == [] and data["threshold"] is None and 0 < data["kv_bytes"] < data["full_kv_bytes"]
    assert (
        data["summary"]
        .split("\n")[1]
        .startswith("answer from window_question x randomized @ 0.25: largest token certificate ")
    )
    page = out_html.read_text()
    assert len(TOKEN_SPAN.findall(page)) == len(data["steps"])
    assert "no certificate escalation threshold applied" in page
    # --escalate study4 (study 4's rule): either the answer kept its compressed cache, or it was restarted once,
    # from its first token, with the full cache
    assert main([*args, "--escalate", "study4"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    if data["escalations"]:
        (esc,) = data["escalations"]
        assert esc["token"] == 0 and esc["budget_to"] == 1.0 and data["kv_bytes"] == data["full_kv_bytes"]
        assert "[restarted with the full cache: the answer's largest certificate" in out
        assert data["summary"].split("\n")[1].startswith("answer from the full cache (restarted from budget 0.25: ")
    else:
        assert (
            data["summary"]
            .split("\n")[1]
            .startswith("answer from window_question x randomized @ 0.25: largest token certificate ")
        )
        assert 0 < data["kv_bytes"] < data["full_kv_bytes"]
    page = out_html.read_text()
    # the legend's scale is the threshold the escalation used: the shipped file's for budget 0.25, not the pooled one
    threshold = shipped(SMOL).threshold(STUDY4_ESCALATION.rate, 0.25)
    assert data["threshold"] == threshold != shipped(SMOL).threshold(STUDY4_ESCALATION.rate)
    assert f"certificate 0 &rarr; {threshold:.3g} (the escalation threshold" in page


def test_calibrate_writes_a_file_generate_accepts(tmp_path, monkeypatch, capsys, tiny_smol):
    """The tiny model under the packaged name: `kvcert calibrate` fits and saves a file for that name, the default
    policy and the budgets asked for, prints its report, and `kvcert generate` then uses it (every token trusted)."""
    model, tok = tiny_smol
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    out = tmp_path / "cal.json"
    args = ["calibrate", "--model", "smollm2", "--tasks", "single_needle", "--lengths", "200", "--n", "4",
            "--budgets", "0.25,0.5", "--seed", "5000", "--out", str(out)]  # fmt: skip
    with no_eos(model):
        assert main(args) == 0
    printed = capsys.readouterr().out
    cal = Calibration.load(out)
    assert (cal.model, cal.n_layers, cal.budgets) == (SMOL, model.config.num_hidden_layers, [0.25, 0.5])
    assert cal.policy == _policy_fields() and cal.data["tasks"] == ["single_needle"] and cal.data["n_examples"] == 4
    assert all(m is not None and m > 0 for m in cal.multipliers)
    assert f"calibration of {SMOL}" in printed and "held-out coverage" in printed
    doc = tmp_path / "doc.txt"
    doc.write_text(make_examples("single_needle", 1, 200, tok, seed=7006)[0].context)
    with no_eos(model):
        assert main(_generate_args(doc, "--calibration", str(out), "--max-new-tokens", "4")) == 0
    printed = capsys.readouterr().out
    assert "largest token certificate" in printed and "uncalibrated" not in printed
