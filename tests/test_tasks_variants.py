"""Study 4's task templates (kvcert.tasks.ruler_variants): determinism, prefixes, needles, wordings, word answers,
the difficulty knobs, context length, rendering, and the registration beside the five tasks of studies 1-3."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from kvcert.tasks import (
    ALL_TASKS,
    DIFFICULTY,
    TASKS,
    VARIANT_TASKS,
    TaskError,
    check_difficulty,
    default_depth,
    make_examples,
    render,
    ruler,
    score,
)
from kvcert.tasks.ruler_variants import NUMBER_WORDINGS, WORD_WORDINGS, Wording


@pytest.fixture(scope="module")
def examples_1k(smol_tokenizer) -> dict:
    return {task: make_examples(task, 6, 1000, smol_tokenizer, seed=0) for task in VARIANT_TASKS}


def _pattern(wording: Wording) -> re.Pattern:
    """The needle sentence of a wording as a regex with the key and value as groups."""
    parts = re.split(r"(\{key\}|\{value\})", wording.needle)
    body = "".join(
        {"{key}": r"(?P<key>[a-z]+-[a-z]+)", "{value}": r"(?P<value>[a-z0-9]+)"}.get(p, re.escape(p)) for p in parts
    )
    return re.compile(body)


def _asked(question: str, wordings) -> tuple[Wording, str]:
    """The wording and the key a question asks with."""
    (hit,) = [
        (w, m["key"])
        for w in wordings
        if (m := re.fullmatch(re.escape(w.question).replace(re.escape("{key}"), r"(?P<key>[a-z]+-[a-z]+)"), question))
    ]
    return hit


def _needles(context: str, wordings) -> list[tuple[str, str]]:
    """(key, value) of every needle of the given wordings in a context."""
    return [(m["key"], m["value"]) for w in wordings for m in _pattern(w).finditer(context)]


def test_registered_beside_the_five_tasks() -> None:
    assert TASKS == ruler.TASKS and len(TASKS) == 5  # studies 1-3's list is unchanged
    assert VARIANT_TASKS == ("needle_reworded", "word_needle", "multikey_words")
    assert ALL_TASKS == TASKS + VARIANT_TASKS
    assert {t: DIFFICULTY[t] for t in TASKS} == ruler.DIFFICULTY
    assert {t: DIFFICULTY[t][:2] for t in VARIANT_TASKS} == {
        "needle_reworded": ("digits", 7),
        "word_needle": ("distractors", 2),
        "multikey_words": ("distractors", 3),
    }


def test_the_five_tasks_pass_through_unchanged(smol_tokenizer) -> None:
    for task in ("single_needle", "fact_qa"):
        assert make_examples(task, 2, 600, smol_tokenizer, seed=3) == ruler.make_examples(
            task, 2, 600, smol_tokenizer, seed=3
        )
    assert make_examples("multikey_needle", 1, 600, smol_tokenizer, seed=3, level=9) == ruler.make_examples(
        "multikey_needle", 1, 600, smol_tokenizer, seed=3, level=9
    )


def test_same_seed_is_identical_and_seeds_differ(smol_tokenizer, examples_1k) -> None:
    for task in VARIANT_TASKS:
        again = make_examples(task, 6, 1000, smol_tokenizer, seed=0)
        assert json.dumps([dataclasses.asdict(e) for e in again]) == json.dumps(
            [dataclasses.asdict(e) for e in examples_1k[task]]
        )
        other = make_examples(task, 6, 1000, smol_tokenizer, seed=1)
        assert all(a.context != b.context and a.answers != b.answers for a, b in zip(other, again))


def test_examples_are_prefix_stable(smol_tokenizer, examples_1k) -> None:
    for task in VARIANT_TASKS:
        assert make_examples(task, 3, 1000, smol_tokenizer, seed=0) == examples_1k[task][:3]


def test_ids_fields_and_depths(examples_1k) -> None:
    ex = examples_1k["word_needle"][4]
    assert ex.id == "word_needle-1k-s0-0004" and ex.task == "word_needle" and ex.target_tokens == 1000
    for task, exs in examples_1k.items():
        for i, ex in enumerate(exs):
            assert ex.metric == "ruler_all" and len(ex.answers) == 1 and ex.stop_strings is None
            assert abs(ex.depth - default_depth(i)) <= 0.05, (task, i, ex.depth)
            assert abs(ex.context.index(ex.answers[0]) / len(ex.context) - ex.depth) <= 0.05
            assert ex.question not in ex.context
    assert len({e.id for exs in examples_1k.values() for e in exs}) == 6 * len(VARIANT_TASKS)


def test_every_needle_and_answer_occurs_once(examples_1k) -> None:
    wordings = {"needle_reworded": NUMBER_WORDINGS, "word_needle": WORD_WORDINGS, "multikey_words": WORD_WORDINGS}
    expected = {"needle_reworded": 1, "word_needle": 3, "multikey_words": 4}  # 1 + the default distractors
    for task, exs in examples_1k.items():
        for ex in exs:
            needles = _needles(ex.context, wordings[task])
            assert len(needles) == expected[task], (task, ex.id, needles)
            (gold,) = ex.answers
            assert [v for _, v in needles].count(gold) == 1
            for key, value in needles:  # every needle's key and value once in the whole context
                assert ex.context.lower().count(value) == 1 and ex.context.count(key) == 1, (ex.id, key, value)
            target_key = next(k for k, v in needles if v == gold)
            assert target_key in ex.question and target_key in ex.answer_prefix


def test_wording_variety(smol_tokenizer) -> None:
    for task, wordings in (
        ("needle_reworded", NUMBER_WORDINGS),
        ("word_needle", WORD_WORDINGS),
        ("multikey_words", WORD_WORDINGS),
    ):
        used = set()
        for ex in make_examples(task, 20, 300, smol_tokenizer, seed=0):
            wording, key = _asked(ex.question, wordings)
            used.add(wording)
            # the asked key's needle is in the question's wording and holds the gold answer
            assert wording.needle.format(key=key, value=ex.answers[0]) in ex.context
            assert ex.answer_prefix == wording.prefix.format(key=key)
        assert len(used) >= 3, (task, len(used))


def test_word_answers_are_words_and_numbers_are_numbers(smol_tokenizer) -> None:
    words = [
        ex.answers[0]
        for task in ("word_needle", "multikey_words")
        for ex in make_examples(task, 20, 300, smol_tokenizer, seed=4)
    ]
    assert all(w.isalpha() and w == w.lower() and len(w) >= 5 for w in words)
    assert len(set(words)) >= 30  # real and invented words, rarely repeated
    numbers = [ex.answers[0] for ex in make_examples("needle_reworded", 10, 300, smol_tokenizer, seed=4)]
    assert all(n.isdigit() and len(n) == 7 for n in numbers)


def test_difficulty_knobs(smol_tokenizer) -> None:
    for level in (0, 6, 9):  # distractor needles: other keys and other words
        (ex,) = make_examples("word_needle", 1, 800, smol_tokenizer, seed=1, level=level)
        assert len(_needles(ex.context, WORD_WORDINGS)) == level + 1
        (ex,) = make_examples("multikey_words", 1, 800, smol_tokenizer, seed=1, level=level)
        needles = _needles(ex.context, WORD_WORDINGS)
        assert len(needles) == level + 1 and len({k for k, _ in needles}) == level + 1
        assert ex.id == f"multikey_words-d{level}-800-s1-0000"
    # word_needle's distractors use the other wordings; multikey_words' share the target's
    (ex,) = make_examples("word_needle", 1, 800, smol_tokenizer, seed=1, level=5)
    assert sum(bool(_pattern(w).search(ex.context)) for w in WORD_WORDINGS) == 6
    (ex,) = make_examples("multikey_words", 1, 800, smol_tokenizer, seed=1, level=5)
    assert sum(bool(_pattern(w).search(ex.context)) for w in WORD_WORDINGS) == 1
    for digits in (3, 12):
        (ex,) = make_examples("needle_reworded", 1, 300, smol_tokenizer, seed=1, level=digits)
        assert len(ex.answers[0]) == digits and ex.answers[0].isdigit()
    # the default level, absent or explicit, is the same examples and ids
    for task in VARIANT_TASKS:
        default = DIFFICULTY[task][1]
        assert make_examples(task, 2, 300, smol_tokenizer, seed=2, level=default) == make_examples(
            task, 2, 300, smol_tokenizer, seed=2
        )


def test_bad_levels_and_tasks_are_one_line(smol_tokenizer) -> None:
    assert check_difficulty({"word_needle": 5, "fact_qa": 3}) == {"word_needle": 5, "fact_qa": 3}
    with pytest.raises(TaskError, match=r"word_needle's knob is its distractors \(default 2\), an integer in 0\.\.40"):
        check_difficulty({"word_needle": 41})
    with pytest.raises(TaskError, match=r"needle_reworded's knob is its digits \(default 7\), an integer in 1\.\.20"):
        make_examples("needle_reworded", 1, 300, smol_tokenizer, seed=0, level=0)
    with pytest.raises(TaskError, match="has no difficulty knob; use .*multikey_words"):
        check_difficulty({"squad": 2})
    with pytest.raises(TaskError, match="unknown task 'nope': use one of .*word_needle"):
        make_examples("nope", 1, 300, smol_tokenizer, seed=0)


@pytest.mark.parametrize("length", [1000, 2000])
def test_context_token_count_within_5_percent(smol_tokenizer, length: int) -> None:
    for task in VARIANT_TASKS:
        for ex in make_examples(task, 3, length, smol_tokenizer, seed=2):
            n_tokens = len(smol_tokenizer(ex.context, add_special_tokens=False).input_ids)
            assert abs(n_tokens - length) <= 0.05 * length, (task, n_tokens)


def test_render_boundary_stops_and_scoring(smol_tokenizer, examples_1k) -> None:
    for exs in examples_1k.values():
        for ex in exs:
            r = render(ex, smol_tokenizer)
            head = smol_tokenizer.decode(r.input_ids[: r.question_start], skip_special_tokens=False)
            tail = smol_tokenizer.decode(r.input_ids[r.question_start :], skip_special_tokens=False)
            assert head.endswith(ex.context) and ex.question in tail
            assert tail.endswith("<|im_start|>assistant\n" + ex.answer_prefix)
            assert {"<|im_end|>", ".", "\n"} <= set(r.stop_strings)  # a single answer: stops at its period
            # the whole prompt fits the requested length plus the template and the question
            n_context = len(smol_tokenizer(ex.context, add_special_tokens=False).input_ids)
            assert abs(n_context - 1000) <= 50 and len(r.input_ids) - r.question_start <= 80
            gold = ex.answers[0]
            assert score(f" {gold.capitalize()}.", ex) == (1.0, True)
            assert score(" something else.", ex) == (0.0, False)
            # the answer fits in the 24 new tokens: the gold plus its period
            assert len(smol_tokenizer(f" {gold}.", add_special_tokens=False).input_ids) <= 12


def test_config_accepts_the_new_tasks() -> None:
    from hydra import compose, initialize_config_dir

    from kvcert.config import ConfigError, result_name, validate
    from kvcert.run import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["task.tasks=[needle_reworded,word_needle,multikey_words,single_needle]"])
        validate(cfg)
        named = compose("config", overrides=["task.tasks=[word_needle]", "+task.difficulty.word_needle=2"])
        plain = compose("config", overrides=["task.tasks=[word_needle]"])
        assert result_name(named) == result_name(plain)  # a level at its default names the same folder
        harder = compose("config", overrides=["task.tasks=[word_needle]", "+task.difficulty.word_needle=5"])
        validate(harder)
        assert result_name(harder) != result_name(plain)
        with pytest.raises(ConfigError, match="multikey_words's knob"):
            validate(compose("config", overrides=["task.tasks=[multikey_words]", "+task.difficulty.multikey_words=-1"]))
        with pytest.raises(ConfigError, match="task.tasks='word_needles'"):
            validate(compose("config", overrides=["task.tasks=[word_needles]"]))
