"""The scorecard (strict JSON, Markdown, HTML) and its figures (kvcert.analysis.scorecard, figures)."""

from __future__ import annotations

import json

import pytest

from kvcert.analysis import figures, scorecard
from kvcert.analysis.claims import evaluate_claim, evaluate_t1, load_predictions
from synthetic import ROOT, filled_spec, synthetic_examples

# --- scorecard and figures -------------------------------------------------------------------------------------


def test_scorecard_strict_json_md_html_and_figures(tmp_path):
    good = synthetic_examples(n=300, cert_signal=3.0, conf_signal=0.0)
    results = {cid: evaluate_claim(cid, good, None, filled_spec(cid)) for cid in ("C2", "C4", "C5", "C6", "C7")}
    t1 = {
        "lambda": [0, 1, 2],
        "true_error_deterministic": [0.1, 0.4, 0.8],
        "estimate_deterministic": [0.1] * 3,
        "mse_randomized": [0.01, 0.02, 0.03],
        "mean_vhat_randomized": [0.01, 0.02, 0.03],
    }
    results["T1"] = evaluate_t1(t1, load_predictions(ROOT / "preregistration" / "predictions.yaml")["T1"])
    results["C4"].metrics["auc_cert"]["lo"] = float("nan")  # NaN must become null
    lock = {
        "status": "deviates",
        "changed": ["preregistration/predictions.yaml"],
        "missing": [],
        "added": [],
        "deviations_recorded": False,
    }
    card = scorecard.build_scorecard(list(results.values()), lock)
    assert [c["id"] for c in card["claims"]] == ["C1", "C2", "C3", "C4", "C5", "C6", "C7", "T1"]
    assert card["claims"][0]["evaluated"] is False
    figs = figures.make_figures(results, good.iloc[:400], t1, tmp_path / "figures", n_boot=20)
    assert len(figs) == 6 and all(p.stat().st_size > 1000 for p in figs)
    paths = scorecard.write_scorecard(card, tmp_path, figs)
    parsed = json.loads(paths["json"].read_text(), parse_constant=lambda c: pytest.fail(f"non-strict {c}"))
    assert parsed["claims"][3]["metrics"]["auc_cert"]["lo"] is None
    for c in parsed["claims"]:
        assert {"id", "prediction", "observed", "ci", "verdict", "paper_verdict", "agrees_with_paper"} <= set(c)
    md = paths["md"].read_text()
    assert "DEVIATES from pre-registration: preregistration/predictions.yaml" in md
    ids = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("|")]
    assert ids[0] == "id" and ids[2:] == ["C1", "C2", "C3", "C4", "C5", "C6", "C7", "T1"]
    html = paths["html"].read_text()
    assert '<img src="figures/c4_roc.png"' in html
    ok = scorecard.build_scorecard([], {"status": "verified", "changed": [], "missing": [], "added": []})
    assert ok["lock"]["line"].endswith("locked and verified")
