"""Study 4's draft machinery: the evaluation of escalation signals at matched rates against a hand computation, the
split, the within-cell AUROC, and the resumable collection on a tiny model."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvcert.studies.study4.analysis import (
    evaluate,
    in_calibration_split,
    policy_outcomes,
    pooled_auroc,
    within_cell_auroc,
)


def test_the_split_is_fixed_and_near_its_share():
    ids = [f"task-1k-s8000-{i:04d}" for i in range(2000)]
    share = np.mean([in_calibration_split(i) for i in ids])
    assert abs(share - 0.3) < 0.04
    assert [in_calibration_split(i) for i in ids[:50]] == [in_calibration_split(i) for i in ids[:50]]


def test_within_cell_auroc_counts_only_pairs_inside_a_cell():
    labels = np.array([True, False, True, False])
    scores = np.array([0.9, 0.1, 0.2, 0.3])
    cells = np.array(["a", "a", "b", "b"])
    assert pooled_auroc(labels, scores) == pytest.approx(3 / 4)  # (0.9>0.1, 0.9>0.3, 0.2>0.1, 0.2<0.3)
    assert within_cell_auroc(labels, scores, cells) == pytest.approx(1 / 2)  # a: right, b: wrong
    assert math.isnan(within_cell_auroc(labels, scores, np.array(["a", "b", "c", "d"])))


def test_a_policy_escalates_above_the_calibration_quantile_and_takes_the_full_answer():
    cal = pd.DataFrame({"score_certificate": np.arange(10, dtype=float)})  # quantile(0.8) = 7.2
    conf = pd.DataFrame(
        dict(
            example_id=["a", "b", "c"],
            score_certificate=[8.0, 7.0, np.nan],
            correct=[False, True, False],
            full_correct=[True, False, True],
            kv_bytes=[10, 10, 10],
            full_kv_bytes=[40, 40, 40],
            prompt_tokens=[100, 200, 300],
        )
    )
    out, threshold = policy_outcomes(conf, cal, "certificate", 0.2)
    assert threshold == pytest.approx(7.2)
    assert out["escalated"].tolist() == [True, False, False]  # NaN never escalates
    assert out["correct"].tolist() == [1.0, 1.0, 0.0] and out["kv_bytes"].tolist() == [40, 10, 10]
    assert out["extra_prefill"].tolist() == [100, 0, 0]


def _synthetic(n: int = 400, seed: int = 0) -> pd.DataFrame:
    """Cache-induced failures the certificate sees and confidence does not."""
    rng = np.random.default_rng(seed)
    failure = rng.uniform(size=n) < 0.3
    return pd.DataFrame(
        dict(
            example_id=[f"e{i:04d}" for i in range(n)],
            task=np.where(np.arange(n) % 2, "t1", "t2"),
            context_tokens=np.where(np.arange(n) % 3, 1000, 2000),
            budget=0.5,
            correct=~failure,
            full_correct=True,
            certificate=failure + rng.normal(0, 0.3, n),
            logprob=-rng.exponential(1.0, n),
            probe_error=rng.uniform(0, 0.2, n),
            kv_bytes=100,
            full_kv_bytes=400,
            prompt_tokens=1000,
        )
    )


def test_evaluate_matches_a_hand_computation_and_ranks_the_informative_signal_first():
    answers = _synthetic()
    res = evaluate(answers, rates=(0.2,), n_boot=200)
    table = res["outcomes"].set_index("signal")
    conf = answers[~answers["example_id"].map(in_calibration_split)].sort_values("example_id")
    cal = answers[answers["example_id"].map(in_calibration_split)]
    threshold = np.quantile(cal["certificate"], 0.8)
    esc = conf["certificate"].to_numpy() > threshold
    expected = 100 * np.where(esc, conf["full_correct"], conf["correct"]).mean()
    assert table.loc["certificate", "accuracy"] == pytest.approx(expected)
    assert table.loc["certificate", "mean_kv_mib"] == pytest.approx((100 + 300 * esc.mean()) / 2**20)
    assert table.loc["certificate", "accuracy"] > table.loc["confidence", "accuracy"]
    diff = res["differences"].set_index(["a", "b"]).loc[("certificate", "confidence")]
    assert diff["lo"] > 0 and diff["lo"] <= diff["diff"] <= diff["hi"]
    disc = res["discrimination"].set_index("signal")
    assert disc.loc["certificate", "auroc_pooled"] > 0.8 and abs(disc.loc["confidence", "auroc_pooled"] - 0.5) < 0.12


def test_collection_resumes_without_duplicates_and_its_full_answer_is_the_full_cache(tmp_path, tiny_smol):
    from kvcert.bench.common import no_eos
    from kvcert.studies.study4.collect import collect, load_answers
    from kvcert.tasks import make_examples

    model, tok = tiny_smol
    examples = make_examples("needle_reworded", 2, 200, tok, seed=8900)
    with no_eos(model):
        path = collect(model, tok, examples[:1], [0.5, 0.25], tmp_path, model_name="tiny", log=None)
        with path.open("a") as f:
            f.write('{"example_id": "cut sh')  # a line cut short by a kill
        collect(model, tok, examples, [0.5, 0.25], tmp_path, model_name="tiny", log=None)
    rows = load_answers(path)
    assert len(rows) == 4 and rows.groupby("example_id").size().tolist() == [2, 2]
    assert (rows["full_kv_bytes"] >= rows["kv_bytes"]).all() and rows["probe_error"].gt(0).all()
    assert set(rows["budget"]) == {0.5, 0.25} and rows["full_answer"].nunique() <= 2


def test_the_report_renders_every_table():
    from kvcert.studies.study4.analysis import report

    text = report(_synthetic(n=120), "synthetic", n_boot=50)
    assert text.startswith("# synthetic") and text.count("|---") >= 4 and "certificate" in text
