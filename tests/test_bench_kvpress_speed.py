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


def test_the_report_gives_the_ratio_and_its_ceilings_from_the_measured_parts(tmp_path, monkeypatch, tiny_smol):
    """Known values through main(): kvpress 11 s a prompt, kvcert read 1.5 s + decode 0.5 s, one forward 1 s ->
    per configuration 1.0 s vs 2/11 s = 5.5x; ceilings 11 / 1.5 and 11 / 1.0."""
    import json

    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setattr(kvpress_speed, "load_model", lambda name: tiny_smol)
    monkeypatch.setattr(kvpress_speed, "kvpress_seconds", lambda *a: [11.0, 11.0])
    part = dict(total=2.0, read=1.5, decode=0.5, plain_forward=1.0)
    monkeypatch.setattr(kvpress_speed, "kvcert_seconds", lambda model, items: [part] * len(items))
    out = tmp_path / "out"
    assert kvpress_speed.main(["--n", "2", "--reps", "1", "--context-tokens", "200", "--kvpress-python", str(python),
                               "--out", str(out)]) == 0  # fmt: skip
    result = json.loads((out / "kvpress_speed.json").read_text())
    assert result["ratio"] == pytest.approx(5.5)
    assert result["ratio_free_decode"] == pytest.approx(11 / 1.5) and result["ratio_one_forward"] == pytest.approx(11)
    text = (out / "kvpress_speed.md").read_text()
    assert (
        "**5.5x**" in text and "| kvpress (each configuration on its own)" in text and "7.3x with a free decode" in text
    )
