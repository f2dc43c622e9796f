"""task=jsonl: a user's JSON-lines file runs as a cell labelled with the file's stem, scored with the chosen metric
(built in or a callable by dotted name); a bad row is one line naming the row and the field, and nothing is
written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from conftest import compose
from kvcert.config import ConfigError, result_name, validate
from kvcert.run import load_examples, run_cell
from kvcert.tasks import Example, TaskError, load_jsonl_examples, render, score
from kvcert.tasks.datasets_hf import truncate

ROWS = [
    {"passage": "Bob keeps the red key under the blue mat by the door.", "question": "Where?", "gold": ["mat"]},
    {"passage": "The train to Ostrava leaves at nine from platform four.", "question": "Which platform?", "gold": "4"},
    {
        "passage": "Anna planted tulips, roses and a single fig tree.",
        "question": "Which tree?",
        "gold": ["fig", "a fig"],
    },
]
FIELDS = {"context": "passage", "answers": "gold"}
CALLS: list[tuple[str, tuple[str, ...]]] = []


def quarter(prediction: str, answers: tuple[str, ...]) -> float:
    """A custom metric (named by dotted path in the tests): records its calls, scores 0.25."""
    CALLS.append((prediction, answers))
    return 0.25


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _jsonl(path: Path, *extra: str) -> list[str]:
    fields = ["task.fields.context=passage", "task.fields.answers=gold"]
    return ["task=jsonl", f"task.path={path}", *fields, *extra]


CELL = [
    "budget=0.5",
    "decode.max_new_tokens=3",
    "threads=1",
    "policy.grid=[{scorer: window_question, designs: [randomized]}]",
]


def test_a_jsonl_cell_is_labelled_with_the_file_stem_and_scored_with_the_chosen_metric(tmp_path, tiny_smol):
    data = _write(tmp_path / "my_qa.jsonl", ROWS)
    cfg = compose([f"results_dir={tmp_path / 'runs'}", *_jsonl(data, f"task.metric={__name__}:quarter"), *CELL])
    CALLS.clear()
    model, tok = tiny_smol
    run_dir = run_cell(cfg, model=model, tokenizer=tok)
    assert run_dir.name.split("__")[1:3] == ["my_qa", "whole"]
    ex = pd.read_parquet(run_dir / "examples.parquet")
    assert set(ex.task) == {"my_qa"} and ex.example_id.nunique() == 3
    assert sorted(ex.example_id.unique()) == ["my_qa-000001", "my_qa-000002", "my_qa-000003"]
    assert (ex.score == 0.25).all() and not ex.correct.any()  # the callable's score; < 0.5 is not correct
    assert len(CALLS) == len(ex) and {answers for _, answers in CALLS} == {("mat",), ("4",), ("fig", "a fig")}
    assert set(ex.gold) == {"mat", "4", "fig | a fig"}


@pytest.mark.parametrize(
    "row, message",
    [
        ({"passage": "some text", "question": "q?"}, "row 2 has no field 'gold' (if yours is named otherwise"),
        ({"passage": "some text", "question": "q?", "gold": []}, "row 2 field 'gold' has no non-empty answer"),
        ({"passage": "some text", "question": 7, "gold": ["x"]}, "row 2 field 'question' is a int, expected a string"),
        ({"passage": "some text", "question": "q?", "gold": [3]}, "row 2 field 'gold' holds a int (3), expected"),
        ('{"passage": "some text",', "row 2 is not valid JSON"),
        ("[1, 2]", "row 2 is a JSON list, not an object"),
    ],
    ids=["missing", "empty-answers", "question-type", "answer-type", "json", "not-object"],
)
def test_a_bad_row_is_one_line_naming_the_row_and_the_field(tmp_path, tiny_smol, row, message):
    data = _write(tmp_path / "bad.jsonl", [ROWS[0], row, ROWS[1], {"passage": "x"}])
    cfg = compose([f"results_dir={tmp_path / 'runs'}", *_jsonl(data), *CELL])
    model, tok = tiny_smol
    with pytest.raises(TaskError) as err:
        run_cell(cfg, model=model, tokenizer=tok)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"bad.jsonl: {message}"), msg
    assert "(and 1 more bad rows)" in msg  # row 4 lacks the question too
    no_model = compose([f"results_dir={tmp_path / 'runs'}", *_jsonl(data), *CELL, "model=hf", "model.name=/no/model"])
    with pytest.raises(TaskError, match="bad.jsonl: row 2"):  # the rows are checked before a model is loaded
        run_cell(no_model)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))  # nothing written


def test_builtin_metrics_exact_contains_f1() -> None:
    def ex(metric: str) -> Example:
        return Example("x", "t", "ctx", "q?", ("The Fig Tree", "fig"), math.nan, metric, 0)

    assert score("the fig tree.", ex("exact")) == (1.0, True)  # SQuAD-normalized exact match
    assert score("a fig tree by the door", ex("exact")) == (0.0, False)
    assert score("It is a FIG.", ex("contains")) == (1.0, True)
    assert score("a date palm", ex("contains")) == (0.0, False)
    value, ok = score("fig tree", ex("f1"))
    assert ok and value == pytest.approx(1.0)


def test_metric_and_keys_are_checked_at_start_in_one_line(tmp_path) -> None:
    data = _write(tmp_path / "qa.jsonl", ROWS)
    cases = [
        (["task=jsonl"], "task=jsonl needs task.path="),
        (["task=jsonl", f"task.path={tmp_path / 'none.jsonl'}"], "is not a file"),
        (_jsonl(data, "task.metric=bleu"), "task.metric='bleu': use exact, contains, f1 or a callable"),
        (_jsonl(data, "task.metric=no_such_module_xyz:f"), "cannot import no_such_module_xyz"),
        (_jsonl(data, f"task.metric={__name__}:nothing"), f"{__name__} has no 'nothing'"),
        (_jsonl(data, "task.truncation=top"), "task.truncation='top' is not allowed"),
        (_jsonl(data, "task.max_context_tokens=10"), "task.max_context_tokens=10"),
        (["task.metric=exact"], "task.metric is read by task=jsonl only"),
        (["task.n_examples=null"], "task.n_examples=null (every row) is for task=jsonl only"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as err:
            validate(compose(overrides))
        assert message in str(err.value) and "\n" not in str(err.value), (overrides, str(err.value))
    validate(compose(_jsonl(data, "task.metric=contains", "task.max_context_tokens=64", "task.truncation=left")))


def test_folder_name_follows_the_file_and_its_content(tmp_path) -> None:
    data = _write(tmp_path / "qa.jsonl", ROWS)
    first = result_name(compose(_jsonl(data)))
    assert first.split("__")[1:3] == ["qa", "whole"]
    assert result_name(compose(_jsonl(data, "task.max_context_tokens=500"))).split("__")[2] == "500"
    assert result_name(compose(_jsonl(data, "task.metric=exact"))) != first
    _write(data, ROWS[:2])  # an edited file is new data: a new folder, never a silent resume
    assert result_name(compose(_jsonl(data))) != first


def test_stop_strings_n_examples_and_truncation_sides(tmp_path, smol_tokenizer) -> None:
    words = " ".join(f"word{i}" for i in range(200))
    data = _write(tmp_path / "long.jsonl", [{**r, "passage": f"{words} {r['passage']}"} for r in ROWS])
    stops = "task.stop_strings=[';', ' because']"
    cfg = compose(_jsonl(data, "task.n_examples=2", stops, "task.max_context_tokens=64"))
    examples = load_examples(cfg, smol_tokenizer)
    assert len(examples) == 2 and examples[0].stop_strings == (";", " because")
    rendered = render(examples[0], smol_tokenizer)
    assert rendered.stop_strings[-2:] == (";", " because") and "\n" not in rendered.stop_strings
    full = load_jsonl_examples(data, fields=FIELDS)[0]
    assert "." in render(full, smol_tokenizer).stop_strings  # stop_strings null: the template's defaults
    n_tokens = len(smol_tokenizer(examples[0].context, add_special_tokens=False)["input_ids"])
    assert n_tokens <= 66 and examples[0].context.startswith("word0") and examples[0].context.endswith("door.")
    left, right = (truncate(full, smol_tokenizer, 64, side) for side in ("left", "right"))
    assert left.context.endswith("door.") and not left.context.startswith("word0 ")
    assert right.context.startswith("word0") and "door" not in right.context
    with pytest.raises(TaskError, match="has 3 rows, task.n_examples=5"):
        load_jsonl_examples(data, fields=FIELDS, n=5)
