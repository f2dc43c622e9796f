"""Policies: one home for the range checks, when compression happens, labels that name what differs."""

import pytest

from kvcert.core.designs import DESIGN_SPECS
from kvcert.core.scorers import SCORERS
from kvcert.policy import FULL, Policy


def test_defaults_reproduce_each_scorers_protocol():
    assert Policy(scorer="window_context", design="topk", budget=0.5).compress_after == "context"
    for scorer in ("window_question", "streaming", "key_norm", "random"):
        p = Policy(scorer=scorer, design="topk", budget=0.5)
        assert p.compress_after == "prompt" and p.question_aware
        assert p.protect_question == (scorer == "window_question")  # the others may evict the question's tokens
    assert FULL.is_full and FULL.label == "full" and not FULL.has_certificate


def test_label_names_only_what_differs_from_the_scorers_default():
    base = Policy(scorer="streaming", design="randomized", budget=0.25, tail_fraction=0.75, seed=2)
    assert base.label == "streaming/randomized/b0.25/t0.75/f0.2/p1/s2"  # unchanged from study 1's records
    kv = Policy(scorer="streaming", design="topk", budget=0.25, compress_after="context")
    assert kv.label == "streaming/topk/b0.25/after-context" and not kv.question_aware
    assert Policy(scorer="key_norm", design="topk", budget=0.5, protect_question=True).label.endswith("/protect-q")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scorer": "no_such_scorer", "design": "topk", "budget": 0.5}, "scorer must be one of"),
        ({"scorer": "streaming", "design": "bogus", "budget": 0.5}, "design must be one of"),
        ({"scorer": "streaming", "design": "topk", "budget": 0.0}, "budget must be a fraction in (0, 1]"),
        ({"scorer": "streaming", "design": "randomized", "budget": 0.5, "tail_fraction": 1.0}, "tail_fraction"),
        ({"scorer": "streaming", "design": "randomized", "budget": 0.5, "floor": 1.5}, "floor must be in [0, 1]"),
        ({"scorer": "streaming", "design": "randomized", "budget": 0.5, "score_power": 0}, "score_power"),
        ({"scorer": "window_question", "design": "topk", "budget": 0.5, "compress_after": "context"}, "reads the q"),
        ({"scorer": "window_context", "design": "topk", "budget": 0.5, "compress_after": "prompt"}, "last context"),
        (
            {
                "scorer": "key_norm",
                "design": "topk",
                "budget": 0.5,
                "compress_after": "context",
                "protect_question": True,
            },
            "protect_question applies",
        ),
        ({"scorer": "none", "design": "topk", "budget": 1.0}, "full-cache reference"),
    ],
)
def test_bad_policies_fail_with_a_message_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=None) as err:
        Policy(**kwargs)
    assert message in str(err.value)


def test_policy_is_keyword_only():
    with pytest.raises(TypeError):
        Policy("streaming", "topk", 0.5)  # noqa


def test_registries_carry_metadata():
    assert {n for n, s in DESIGN_SPECS.items() if s.has_certificate} == {
        "randomized",
        "randomized_no_offset",
        "uniform",
    }
    assert not DESIGN_SPECS["randomized_no_offset"].offset and DESIGN_SPECS["randomized"].offset
    assert {n: s.window for n, s in SCORERS.items() if s.window} == {
        "window_question": "question",
        "window_context": "context",
        "snapkv": "context",
        "critical_snapkv": "context",
        "tova": "last",
    }


def test_generator_seed_differs_per_example_and_seed():
    p, q = (
        Policy(scorer="random", design="topk", budget=0.5),
        Policy(scorer="random", design="topk", budget=0.5, seed=1),
    )
    assert p.generator_seed("a") != p.generator_seed("b") != q.generator_seed("b")
    assert p.generator_seed("a") == Policy(scorer="random", design="topk", budget=0.5).generator_seed("a")
