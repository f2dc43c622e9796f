"""The difficulty knob of the offline tasks (task.difficulty): default levels change nothing, other levels change
what they say, bad levels are one line."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from kvcert.config import ConfigError, result_name, validate
from kvcert.tasks import DIFFICULTY, TASKS, TaskError, check_difficulty, make_examples
from kvcert.testing import tiny_tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "task_examples_before_difficulty.json"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_default_level_reproduces_the_examples_made_before_the_knob(tok) -> None:
    # hashes of repr(Example) written by the code before the knob existed (3 examples x 5 tasks x 2 lengths)
    before = json.loads(FIXTURE.read_text())
    now = {}
    for task in TASKS:
        for length in (300, 1000):
            for level in (None, DIFFICULTY[task][1]):  # absent and explicitly default: the same examples
                for ex in make_examples(task, 3, length, tok, seed=11, level=level):
                    now[ex.id] = hashlib.sha256(repr(ex).encode()).hexdigest()
    assert now == before


def test_levels_change_what_they_name(tok) -> None:
    single = make_examples("single_needle", 2, 300, tok, seed=1, level=12)
    assert [ex.id for ex in single] == ["single_needle-d12-300-s1-0000", "single_needle-d12-300-s1-0001"]
    assert all(len(ex.answers[0]) == 12 and ex.answers[0].isdigit() for ex in single)
    for level in (0, 9):  # distractor needles: other keys' magic numbers in the context
        (ex,) = make_examples("multikey_needle", 1, 600, tok, seed=1, level=level)
        assert ex.context.count("special magic numbers for") == level + 1
    (ex,) = make_examples("multivalue_needle", 1, 600, tok, seed=1, level=4)
    assert len(ex.answers) == 4 and all(a in ex.context for a in ex.answers)
    for hops in (0, 3):  # the answer is the chain: the first variable and one per hop
        (ex,) = make_examples("variable_tracking", 1, 600, tok, seed=1, level=hops)
        assert len(ex.answers) == hops + 1
        assert len(re.findall(r"VAR [A-Z]{3} = ", ex.context)) == 2 * (hops + 1)  # the chain and its decoy
    (ex,) = make_examples("fact_qa", 1, 800, tok, seed=1, level=9)
    assert sum(ex.context.count(w) for w in ("capital of", "discovered by", "flows into", "first played")) == 10


def test_bad_levels_are_one_line() -> None:
    with pytest.raises(
        TaskError, match=r"multikey_needle's knob is its distractors \(default 3\), an integer in 0\.\.40"
    ):
        check_difficulty({"multikey_needle": -1})
    with pytest.raises(TaskError, match="has no difficulty knob"):
        check_difficulty({"squad": 2})
    with pytest.raises(TaskError, match="an integer"):
        check_difficulty({"single_needle": 7.5})


def test_config_key_validated_and_hashed_only_when_set(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from kvcert.run import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        plain = compose("config")
        default = compose("config", overrides=["+task.difficulty.single_needle=7"])
        harder = compose("config", overrides=["+task.difficulty.single_needle=12"])
        bad = compose("config", overrides=["+task.difficulty.variable_tracking=99"])
    assert result_name(plain) == result_name(default)  # the default level: same records, same folder
    assert result_name(plain) != result_name(harder)
    validate(harder)
    with pytest.raises(ConfigError, match=r"task\.difficulty\.variable_tracking=99"):
        validate(bad)
