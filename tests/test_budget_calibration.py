"""`kvcert.calibrate_budget` / `kvcert calibrate-budget` end to end on the tiny random model and a tiny JSONL, and
`generate(budget=<file>)` / `kvcert generate --budget-file` using the file (kvcert.serve.budget_*)."""

from __future__ import annotations

import json

import pytest

import kvcert
import kvcert.serve
from kvcert.bench.common import no_eos
from kvcert.core.risk_control import min_n
from kvcert.policy import FULL
from kvcert.serve import generate
from kvcert.serve.budget_calibration import calibrate_budget, load_prompts
from kvcert.serve.budget_file import BudgetError, BudgetFile, calibrated_budget
from kvcert.serve.cli import main

WORDS = "the quick brown fox jumps over a lazy dog while seven green parrots sing about distant hills".split()  # noqa: SIM905


def _jsonl(path, kinds=(("easy", 5), ("hard", 5), ("rare", 2)), labelled: bool = True):
    lines = []
    for kind, count in kinds:
        for i in range(count):
            context = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(60)) + f" The code is {100 + i}."
            row = {"context": context, "question": "What is the code?", "kind": kind}
            if labelled:
                row["answers"] = [str(100 + i)]
            lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_file_holds_method_guarantee_groups_risk_per_rung_and_mean_kv(tmp_path, tiny_smol):
    model, tok = tiny_smol
    data = _jsonl(tmp_path / "mine.jsonl")
    out = tmp_path / "budget.json"
    with no_eos(model):
        got = calibrate_budget(model, tok, data, group_field="kind", method="crc", alpha=0.2, max_new_tokens=3,
                               out=out, log=None)  # fmt: skip
    raw = json.loads(out.read_text())
    assert raw["format"] == "kvcert-budget/1" and raw["method"] == "crc" and raw["alpha"] == 0.2
    assert raw["n"] == 12 and raw["ladder"] == [0.1, 0.25, 0.5, 0.75] and raw["group_by"] == "kind"
    assert set(raw["groups"]) == {"easy", "hard", "rare"}
    assert raw["groups"]["rare"]["refused"] and raw["groups"]["rare"]["budget"] == 1.0  # 2 < min n = 4
    assert min_n("crc", 0.2) == 4 and not raw["groups"]["easy"]["refused"]
    pooled = raw["pooled"]
    assert len(pooled["risk"]) == len(pooled["raw_risk"]) == 4
    assert all(a >= b for a, b in zip(pooled["risk"], pooled["risk"][1:]))  # the monotone risk
    assert 0 < raw["mean_kv"]["pooled_share"] <= 1 and 0 < raw["mean_kv"]["per_kind_share"] <= 1
    assert len(raw["prompts"]) == 12
    for p in raw["prompts"]:
        assert len(p["loss"]) == 4 and len(p["kv"]) == 5 and p["kv"][-1] == 1.0
        assert p["kv"] == sorted(p["kv"]) and 0 < p["kv"][0] < 0.5  # the KV share grows with the budget
    assert BudgetFile.load(out).pooled == got.pooled


def test_unlabelled_rows_are_read_for_the_differs_loss_and_refused_for_accuracy(tmp_path, tiny_smol):
    data = _jsonl(tmp_path / "bare.jsonl", labelled=False)
    examples, groups = load_prompts(data, group_field="kind")
    assert len(examples) == 12 and examples[0].answers == () and groups[:6] == ["easy"] * 5 + ["hard"]
    assert examples[0].id == "bare-000001"
    with pytest.raises(ValueError, match="no field 'answers'"):
        load_prompts(data, group_field="kind", need_answers=True)
    with pytest.raises(ValueError, match="row 1 has no group field 'topic'"):
        load_prompts(data, group_field="topic")


def test_too_few_prompts_are_refused_before_anything_is_decoded(tmp_path, tiny_smol):
    model, tok = tiny_smol
    data = _jsonl(tmp_path / "few.jsonl", kinds=(("a", 12),))
    with pytest.raises(BudgetError) as err:  # LTT at alpha = delta = 0.1 needs 22
        calibrate_budget(model, tok, data, alpha=0.1, delta=0.1, log=None)
    with pytest.raises(BudgetError, match="has 12 rows, --n 30; leave --n out for all"):
        calibrate_budget(model, tok, data, n=30, log=None)
    assert "too few for ltt" in str(err.value) and "(1-alpha) = 22;" in str(err.value) and "\n" not in str(err.value)


def _file(tmp_path, budget=0.5, groups=None) -> str:
    sel = dict(method="ltt", alpha=0.1, delta=0.1, n=40, ladder=[0.1, 0.25, 0.5, 0.75], budget=budget,
               fallback=budget >= 1, reason="", risk=[0.5, 0.2, 0.05, 0.0], raw_risk=[0.5, 0.2, 0.05, 0.0],
               statistic=[1, 1, 0.01, 0.001], refused=None)  # fmt: skip
    file = BudgetFile(model=None, policy={k: v for k, v in vars(kvcert.serve.default_policy(0.5)).items()
                                          if k != "budget"}, method="ltt", alpha=0.1, delta=0.1, loss="differs",
                      ladder=[0.1, 0.25, 0.5, 0.75], max_new_tokens=4, prompt_format="auto", n=40, pooled=sel,
                      groups={g: {**sel, "budget": b} for g, b in (groups or {}).items()})  # fmt: skip
    return str(file.save(tmp_path / "b.json"))


@pytest.mark.filterwarnings("ignore:kvcert. no calibration")
def test_generate_uses_the_files_budget_its_groups_and_states_the_guarantee(tmp_path, tiny_smol):
    model, tok = tiny_smol
    path = _file(tmp_path, 0.5, groups={"qa": 0.25, "hard": 1.0})
    context = " ".join(WORDS * 4)
    with no_eos(model):
        out = generate(model, tok, context=context, question="Which animal?", budget=path, max_new_tokens=3,
                       calibration=None)  # fmt: skip
        assert out.policy.budget == 0.5
        assert "budget 0.5 by Learn-then-Test on 40 prompts: with probability >= 0.9" in out.summary()
        qa = generate(model, tok, context=context, question="Which animal?", budget=calibrated_budget(path, "qa"),
                      max_new_tokens=3, calibration=None)  # fmt: skip
        assert qa.policy.budget == 0.25 and "group qa" in qa.summary()
        hard = generate(model, tok, context=context, question="Which animal?",
                        budget=calibrated_budget(path, "hard"), max_new_tokens=3)  # fmt: skip
        assert hard.policy == FULL and hard.kv_bytes == hard.full_kv_bytes
        plain = generate(model, tok, context=context, question="Which animal?", budget=0.5, max_new_tokens=3,
                         calibration=None)  # fmt: skip
    assert plain.guarantee is None and "Learn-then-Test" not in plain.summary()
    assert plain.tokens == out.tokens  # the same budget and policy: the same answer
    with pytest.raises(BudgetError, match="group 'nope' is not in the budget file"):
        calibrated_budget(path, "nope")
    monitor = calibrated_budget(path).monitor(delta=0.05)
    for differs in [1.0] * 20:  # every checked answer differs from the full cache's: far above alpha 0.1
        monitor.update(differs)
    assert monitor.flagged and monitor.line().startswith("risk left the guarantee")
    with pytest.raises(BudgetError, match="not both"):
        generate(model, tok, context=context, question="q?", budget=path, policy=FULL)
    with pytest.raises(BudgetError, match="tolerance= chooses its own budget"):
        generate(model, tok, context=context, question="q?", budget=path, tolerance=0.1)


def test_cli_calibrate_budget_then_generate_with_the_file(tmp_path, monkeypatch, capsys, tiny_smol):
    model, tok = tiny_smol
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: (model, tok))
    data = _jsonl(tmp_path / "mine.jsonl")
    out = tmp_path / "cal.json"
    args = ["calibrate-budget", "--model", "smollm2", "--data", str(data), "--group-field", "kind", "--method", "crc",
            "--alpha", "0.2", "--max-new-tokens", "3", "--out", str(out)]  # fmt: skip
    with no_eos(model):
        assert main(args) == 0
    printed = capsys.readouterr().out
    assert "pooled: " in printed and "group easy: " in printed and "mean KV: pooled" in printed
    assert BudgetFile.load(out).model == "smollm2-135m-instruct"
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(WORDS * 4))
    gen = ["generate", "--model", "smollm2", "--context-file", str(doc), "--question", "Which animal?",
           "--budget-file", str(out), "--group", "easy", "--max-new-tokens", "3", "--calibration", "none"]  # fmt: skip
    with no_eos(model):
        assert main(gen) == 0
    said = capsys.readouterr().out
    # the summary's second line (what the answer came from) states the guarantee
    (line,) = [line for line in said.splitlines() if "conformal risk control" in line]
    assert "conformal risk control on group easy, 5 prompts" in line and not line.startswith("answer:")
    assert main([*args[:-2], "--alpha", "0.01", "--out", str(out)]) == 2  # crc at 0.01 needs 99 prompts
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 12 calibration prompts are too few for crc") and err.count("\n") == 0
    assert main([*gen[:-4], "--group", "nope"]) == 2
    assert "group 'nope' is not in the budget file" in capsys.readouterr().err
    assert main([*gen, "--tolerance", "0.1"]) == 2
    assert "pass --budget-file or --tolerance, not both" in capsys.readouterr().err


def test_packaged_tasks_group_by_task_and_length(tmp_path, tiny_smol):
    model, tok = tiny_smol
    with no_eos(model):
        got = calibrate_budget(model, tok, tasks=["single_needle"], lengths=(150, 200), n=3, method="crc", alpha=0.25,
                               loss="accuracy", max_new_tokens=3, log=None)  # fmt: skip
    assert got.group_by == "task x length" and set(got.groups) == {"single_needle@150", "single_needle@200"}
    assert got.n == 6 and all(p["accuracy"] is not None for p in got.prompts)


def test_a_budget_that_is_text_but_no_file_is_still_refused_as_not_a_number(tmp_path, tiny_smol):
    model, tok = tiny_smol
    with pytest.raises(ValueError, match="the budget 'a quarter' is not a number"):
        generate(model, tok, context="The report was written by Ada.", question="Who?", budget="a quarter")
    with pytest.raises(BudgetError, match="budget file .*missing.json does not exist"):
        generate(model, tok, context="The report was written by Ada.", question="Who?",
                 budget=str(tmp_path / "missing.json"))  # fmt: skip
