"""The claim experiments: configs compose and share one confirmatory cell, T1 demonstrates non-identifiability,
and the whole analysis runs on records from a tiny model into a scorecard with every claim id."""

import json

import pytest

from conftest import compose
from kvcert.claims import CLAIMS, compose_claim, t1_demonstration
from kvcert.config import policies, result_name, validate


def test_claims_c1_to_c7_share_one_confirmatory_cell():
    names = {result_name(compose_claim(CLAIMS[c])) for c in CLAIMS if c != "T1"}
    assert len(names) == 1
    cfg = compose_claim("c1_coverage")
    validate(cfg)
    labels = [p.label for p in policies(cfg)]
    assert len(labels) == len(set(labels))  # no variant twice
    designs = {p.design for p in policies(cfg)}
    assert designs == {"full", "topk", "randomized", "randomized_no_offset", "uniform"}
    assert cfg.seed != compose_claim("pilot").seed  # pilot and confirmatory data are disjoint


def test_t1_deterministic_blind_randomized_tracks():
    cfg = compose_claim("t1_nonidentifiability", ["claim.t1.n=400", "claim.t1.d=32"])
    r = t1_demonstration(cfg, draws=600)
    assert all(r["retained_identical"])
    assert r["estimate_deterministic"] == [0.0] * len(r["lambda"])
    err = r["true_error_deterministic"]
    assert all(b > a for a, b in zip(err, err[1:])) and err[-1] > 5 * err[0]
    ratios = [v / m for v, m in zip(r["mean_vhat_randomized"], r["mse_randomized"])]
    assert all(0.8 < x < 1.25 for x in ratios), ratios
    assert r["mse_randomized"][-1] > 3 * r["mse_randomized"][0]


@pytest.mark.parametrize("claim", [c for c in CLAIMS.values()])
def test_claim_configs_compose_with_the_runner(claim):
    cfg = compose([f"+claim={claim}"])
    validate(cfg)
    assert cfg.claim.id in CLAIMS


def test_analysis_end_to_end_on_tiny_records(tmp_path, tiny_smol):
    """Every claim is evaluated from real runner records (tiny random model): the scorecard lists C1..C7 and T1."""
    from kvcert.analysis.claims import evaluate_claim, evaluate_t1, load_predictions
    from kvcert.analysis.scorecard import build_scorecard, write_scorecard
    from kvcert.run import ROOT, run_cell

    predictions = load_predictions(ROOT / "preregistration" / "predictions.yaml")
    cfg = compose_claim("c1_coverage", [f"results_dir={tmp_path}", "task.n_examples=1", "task.context_tokens=[160]",
                                        "decode.max_new_tokens=4", "threads=1"])
    model, tok = tiny_smol
    run_dir = run_cell(cfg, model=model, tokenizer=tok)
    import pandas as pd

    examples, steps = pd.read_parquet(run_dir / "examples.parquet"), pd.read_parquet(run_dir / "steps.parquet")
    results = []
    for cid in [c for c in CLAIMS if c != "T1"]:
        spec = {**predictions[cid], "n_boot": 50}
        r = evaluate_claim(cid, examples, steps if cid == "C1" else None, spec)
        assert r["verdict"] in {"supported", "refuted", "inconclusive"}
        results.append(r)
    t1 = t1_demonstration(compose_claim("t1_nonidentifiability", ["claim.t1.n=300", "claim.t1.d=16"]), draws=300)
    results.append(evaluate_t1(t1, predictions["T1"]))
    card = build_scorecard(results, {"status": "unlocked", "changed": [], "missing": [], "added": []})
    paths = write_scorecard(card, tmp_path / "out", [])
    data = json.loads(paths["json"].read_text())
    assert [c["id"] for c in data["claims"]] == ["C1", "C2", "C3", "C4", "C5", "C6", "C7", "T1"]
    assert set(data) >= {"lock", "claims"}
