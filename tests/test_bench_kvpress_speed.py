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
    machine = dict(bandwidth_Bps=1e10, matmul_flops=1e10)
    seconds = kvpress_speed.kvcert_seconds(model, items, machine)
    assert len(seconds) == 2
    assert all(s["total"] == pytest.approx(s["read"] + s["decode"]) and min(s.values()) > 0 for s in seconds)


def test_the_decode_limit_is_sixteen_roofline_steps_and_scales_with_the_machine(tiny_smol):
    from kvcert.hf import DecodeOptions, Prompt, generate_variants
    from kvcert.tasks import make_examples, render

    model, tok = tiny_smol
    r = render(make_examples("single_needle", 1, 200, tok, seed=9401)[0], tok)
    prompt = Prompt(input_ids=list(r.input_ids), question_start=r.question_start, example_id="p")
    opts = DecodeOptions(max_new_tokens=kvpress_speed.NEW_TOKENS, oracle=False, certificate=True)
    results = generate_variants(model, None, prompt, kvpress_speed.kvcert_policies(), opts)
    slow = kvpress_speed.decode_limit_s(model, results, prompt, dict(bandwidth_Bps=1e9, matmul_flops=1e9))
    fast = kvpress_speed.decode_limit_s(model, results, prompt, dict(bandwidth_Bps=2e9, matmul_flops=2e9))
    one = kvpress_speed.decode_limit_s(model, results, prompt, dict(bandwidth_Bps=1e9, matmul_flops=1e9), steps=1)
    # sixteen steps cost at least sixteen first steps (later steps hold more generated tokens)
    assert slow > 0 and fast == pytest.approx(slow / 2) and kvpress_speed.NEW_TOKENS * one <= slow < 17 * one


def test_it_refuses_in_one_line_without_kvpress_environment(tmp_path):
    with pytest.raises(SystemExit, match="not found; build kvpress's environment"):
        kvpress_speed.main(["--kvpress-python", str(tmp_path / "nope" / "python")])


def test_the_report_gives_the_ratio_and_its_ceilings_from_the_measured_parts(tmp_path, monkeypatch, tiny_smol):
    """Known values through main(): kvpress 11 s a prompt, kvcert read 1.5 s + decode 0.5 s, one forward 1 s ->
    per configuration 1.0 s vs 2/11 s = 5.5x; ceilings 11 / 1.5 and 11 / 1.0; the decode at its roofline 0.25 s ->
    11 / 1.75; the target 0.9 x 11 / 1.5 = 6.6x."""
    import json

    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setattr(kvpress_speed, "load_model", lambda name: tiny_smol)
    monkeypatch.setattr(kvpress_speed, "kvpress_seconds", lambda *a: [11.0, 11.0])
    part = dict(total=2.0, read=1.5, decode=0.5, plain_forward=1.0, decode_limit=0.25)
    monkeypatch.setattr(kvpress_speed, "kvcert_seconds", lambda model, items, machine: [part] * len(items))
    monkeypatch.setattr(kvpress_speed, "measure_machine", lambda model: dict(bandwidth_Bps=2e10, matmul_flops=5e10))
    out = tmp_path / "out"
    assert kvpress_speed.main(["--n", "2", "--reps", "1", "--context-tokens", "200", "--kvpress-python", str(python),
                               "--out", str(out)]) == 0  # fmt: skip
    result = json.loads((out / "kvpress_speed.json").read_text())
    assert result["ratio"] == pytest.approx(5.5)
    assert result["ratio_free_decode"] == pytest.approx(11 / 1.5) and result["ratio_one_forward"] == pytest.approx(11)
    assert result["ratio_roofline_decode"] == pytest.approx(11 / 1.75) and result["target"] == pytest.approx(6.6)
    text = (out / "kvpress_speed.md").read_text()
    assert "target: 0.9x the free-decode ceiling, 6.6x" in text and "ratio of 6.3x (0.86 of the free-decode" in text
    assert "the decode at 0.17 s or less" in text and "reading the weights once per step alone takes" in text
    assert "20.0 GB/s, matmul 50.0 GFLOP/s at M = 11" in text
    assert (
        "**5.5x**" in text and "| kvpress (each configuration on its own)" in text and "7.3x with a free decode" in text
    )
