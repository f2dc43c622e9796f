"""C4, C6 AUROCs (kvcert.analysis.auroc)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from kvcert.analysis import auroc
from synthetic import NB

# --- AUROC (C4, C6) --------------------------------------------------------------------------------------------


def test_auroc_perfect_hand_case_and_ties():
    assert auroc.auroc([1, 1, 0, 0], [0.9, 0.8, 0.2, 0.1]) == 1.0
    assert auroc.auroc([1, 1, 0, 0], [0.9, 0.4, 0.6, 0.1]) == pytest.approx(0.75)  # 3 of 4 pairs ordered
    assert auroc.auroc([1, 0], [0.5, 0.5]) == pytest.approx(0.5)


def test_fast_weighted_auroc_matches_sklearn():
    rng = np.random.default_rng(2)
    y = rng.random(300) < 0.3
    s = np.round(rng.normal(size=300) + y, 1)  # rounding creates ties
    w = rng.integers(0, 4, size=300).astype(float)
    assert auroc.weighted_auroc_stat(y, s)(w) == pytest.approx(roc_auc_score(y, s, sample_weight=w))


def test_degenerate_auroc_returns_nan_and_reason():
    res = auroc.paired_auroc(np.ones(5, bool), np.arange(5.0), np.arange(5.0), np.arange(5), NB)
    assert np.isnan(res["diff"]["estimate"]) and "negatives" in res["reason"]
    assert auroc.roc_points([0, 0], [1, 2]).empty
