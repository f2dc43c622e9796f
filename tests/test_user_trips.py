"""What a new user trips on (issue #54): the summary says the answer first and what its numbers mean, a correct
sentence scores correct under task=jsonl's default metric, every model name works in the API, the CLI and Hydra, a
Hydra typo exits 2 naming the nearest key, errors name the fix, the CLI's help matches its defaults, and a debug
profile says what it changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvcert import Calibration, generate
from kvcert.bench.common import no_eos
from kvcert.serve import calibration as calibration_module
from kvcert.serve.generate import default_policy
from kvcert.tasks import make_examples


def _calibration(hf_model, policy, **overrides) -> Calibration:
    n = hf_model.config.num_hidden_layers
    fields = {k: getattr(policy, k) for k in calibration_module.POLICY_FIELDS}
    args = dict(model="tiny", n_layers=n, policy=fields, budgets=[0.25, 0.5], multipliers=[1.5] * n)
    return Calibration(**{**args, **overrides})


# --------------------------------------------------------------------------------------------------- the summary
def test_the_summary_starts_with_the_answer_and_reads_the_certificate_against_the_calibration(tiny_smol):
    """Line 1 is the answer; line 2 the cache, the largest token certificate (not "max ... (mean": one name for the
    reduction over layers, one for the largest over tokens) above or below the calibration's 20%-rate threshold at
    the budget; line 3 what a user can do. No "tokens trusted" count (it was the same for every answer); the draws'
    disagreement comes with its scale. `answer` is `text`."""
    model, tok = tiny_smol
    ex = make_examples("single_needle", 1, 300, tok, seed=7021)[0]
    policy = default_policy(0.25)
    low = _calibration(model, policy, thresholds={"0.2": -1.0}, reduction="mean")
    high = replace(low, thresholds={"0.2": 1e9})
    kw = dict(context=ex.context, question=ex.question, policy=policy, model_name="tiny", max_new_tokens=4)
    with no_eos(model):
        flagged = generate(model, tok, calibration=low, **kw)
        fine = generate(model, tok, calibration=high, **kw)
        drawn = generate(model, tok, calibration=high, draws=2, **kw)
    assert flagged.answer == flagged.text
    first, second, third = flagged.summary().split("\n")
    assert first == f"answer: {flagged.text.strip()}"
    assert second.startswith("answer from window_question x randomized @ 0.25: largest token certificate ")
    assert "(each token's calibrated 95% relative error radius, mean over layers)" in second
    assert "above the calibration's threshold -1 for a 20% escalation rate at budget 0.25" in second
    assert third.startswith("what you can do: this answer is among the 20% the calibration flags")
    assert "escalate='study4'" in third
    assert "below the calibration's threshold 1e+09" in fine.summary()
    assert "what you can do: nothing flags this answer" in fine.summary()
    for g in (flagged, fine, drawn):
        assert "trusted" not in g.summary() and "certificate max" not in g.summary()
    assert "disagreement" in drawn.summary() and "nats: 0 = the draws agree" in drawn.summary()
    assert flagged.reference_threshold == -1.0 and flagged.to_dict()["summary"] == flagged.summary()


def test_an_uncalibrated_summary_says_the_radius_is_not_a_bound(tiny_smol):
    model, tok = tiny_smol
    ex = make_examples("single_needle", 1, 300, tok, seed=7022)[0]
    with no_eos(model), pytest.warns(UserWarning, match="no calibration"):
        out = generate(model, tok, context=ex.context, question=ex.question, model_name="tiny-uncal-ux",
                       max_new_tokens=3)  # fmt: skip
    assert "uncalibrated: not a bound" in out.summary() and "run `kvcert calibrate`" in out.summary()
    assert out.reference_threshold is None


def test_one_draw_names_the_fix(tiny_smol):
    model, tok = tiny_smol
    with pytest.raises(ValueError, match=r"pass draws=2 or more \(--draws 2\), or draws=None for one draw"):
        generate(model, tok, context="Some text here.", question="What?", draws=1)


def test_the_page_says_the_policy_in_words():
    from kvcert.serve.generation import policy_words

    words = policy_words(default_policy(0.5))
    assert words.startswith("keeps 50% of the prompt's KV, chosen by the window_question scorer")
    assert "25% of the budget the highest-scoring tokens, 75% drawn at random" in words


def test_the_generate_help_states_the_defaults_it_has():
    """`kvcert generate --help` said "by default, study 4's escalation" while the default is none; each default the
    help names is the parser's."""
    from kvcert.serve.cli_parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["generate"]
    text = " ".join(sub.format_help().split())
    assert "by default, study 4" not in text and "Nothing is escalated unless --escalate asks (default none)" in text
    defaults = {a.dest: a.default for a in sub._actions}
    assert defaults["escalate"] == "none" and "(default none)" in text
    assert defaults["budget"] == "0.25" and "(default 0.25)" in text


# ---------------------------------------------------------------------------------------------- your own data
def test_a_correct_sentence_scores_correct_under_the_jsonl_default(tmp_path):
    """A chat model answers in sentences: under token F1 >= 0.5 (the old default) "The key is under the blue mat by
    the door." scored 0.18 against "the blue mat"; the default (conf/task/jsonl.yaml, load_jsonl_examples) checks
    every gold answer as a substring, as the packaged tasks do."""
    import json

    from conftest import compose
    from kvcert.tasks import load_jsonl_examples, score

    data = tmp_path / "mine.jsonl"
    row = {"context": "Bob keeps the red key under the blue mat by the door.", "question": "Where is the key?"}
    data.write_text(json.dumps({**row, "answers": ["the blue mat", "under the mat"]}) + "\n")
    cfg = compose(["task=jsonl", f"task.path={data}"])
    assert cfg.task.metric == "contains"
    (ex,) = load_jsonl_examples(data, metric=cfg.task.metric)
    assert load_jsonl_examples(data)[0].metric == "contains"
    sentence = "The key is under the blue mat by the door, where Bob keeps it."
    assert score(sentence, ex) == (1.0, True) and score("Under the stairs.", ex)[1] is False
    assert score(sentence, load_jsonl_examples(data, metric="f1")[0])[1] is False  # what tripped the user


def test_a_cell_whose_full_cache_scores_zero_warns_in_one_line(tmp_path, tiny_smol, capsys):
    import json

    from conftest import compose
    from kvcert.run import run_cell

    data = tmp_path / "mine.jsonl"
    rows = [{"context": "Anna planted tulips and a single fig tree.", "question": "Which tree?", "answers": ["zq"]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose([f"results_dir={tmp_path / 'runs'}", "task=jsonl", f"task.path={data}", "budget=0.5",
                   "decode.max_new_tokens=2", "threads=1", "records.steps=none",
                   "policy.grid=[{scorer: window_question, designs: [randomized]}]"])  # fmt: skip
    model, tok = tiny_smol
    run_cell(cfg, model=model, tokenizer=tok)
    lines = [x for x in capsys.readouterr().err.splitlines() if "full cache scored 0" in x]
    assert len(lines) == 1 and "task.metric=contains" in lines[0], lines


def test_the_analysis_log_rounds_as_the_scorecard_does():
    """`make analyze` printed 16-digit floats ("observed 0.9136839787046612 CI [0.910976833866059, ...]"); a claim's
    line now carries the scorecard's rounding, and a claim without an evaluation says so."""
    from kvcert.studies.analyze import claim_line

    c1 = {"verdict": "refuted", "observed": 0.9136839787046612, "ci": [0.910976833866059, 0.9162149844440798],
          "unit": "", "paper_verdict": "supported"}  # fmt: skip
    assert claim_line(c1) == "refuted      observed 0.914 [0.911, 0.916] (paper: supported)"
    c2 = {"verdict": "refuted", "observed": -6.26984126984127, "ci": [-8.17, -4.44], "unit": "points"}
    assert claim_line(c2) == "refuted      observed -6.3 [-8.2, -4.4] points (paper: n/a)"
    assert claim_line({"evaluated": False}) == "not evaluated"
