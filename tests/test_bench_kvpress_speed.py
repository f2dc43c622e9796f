"""kvcert.bench.kvpress_speed: the 11 configurations of kvpress's protocol on kvcert's side, and its refusal without
kvpress's environment (the kvpress side itself runs only in .venv-kvpress)."""

from __future__ import annotations

import pytest

from kvcert.bench import kvpress_speed
from kvcert.core.scorers import SCORERS
from kvcert.policy import FULL


def test_the_kvcert_side_decodes_the_full_cache_and_every_press_at_both_kept_shares():
    policies = kvpress_speed.kvcert_policies()
    assert len(policies) == kvpress_speed.N_CONFIGS == 11 and policies[0] == FULL
    pairs = {(p.scorer, p.budget) for p in policies[1:]}
    assert pairs == {(s, b) for s in kvpress_speed.PRESSES.values() for b in (0.5, 0.25)}
    assert all(p.scorer in SCORERS and p.compress_after == "context" and p.has_certificate for p in policies[1:])


def test_one_timed_call_per_prompt_with_every_configuration_in_one_batch(tiny_smol):
    from kvcert.tasks import make_examples, render

    model, tok = tiny_smol
    items = []
    for i, ex in enumerate(make_examples("single_needle", 2, 200, tok, seed=9400)):
        r = render(ex, tok)
        items.append(dict(id=f"p{i}", input_ids=list(r.input_ids), question_start=r.question_start))
    seconds = kvpress_speed.kvcert_seconds(model, items)
    assert len(seconds) == 2
    assert all(s["total"] == pytest.approx(s["read"] + s["decode"]) and min(s.values()) > 0 for s in seconds)


def test_it_refuses_in_one_line_without_kvpress_environment(tmp_path):
    with pytest.raises(SystemExit, match="not found; build kvpress's environment"):
        kvpress_speed.main(["--kvpress-python", str(tmp_path / "nope" / "python")])
