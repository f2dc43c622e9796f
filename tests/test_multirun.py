"""Hydra multirun on the packaged model: `-m budget=... seed=...` runs one cell per job, locally and with the
joblib launcher (separate processes); every job writes its own complete results folder."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "task.tasks=[single_needle]",
    "task.n_examples=1",
    "task.context_tokens=[200]",
    "policy=snapkv",
    "decode.max_new_tokens=4",
    "threads=1",
]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "local"])
def test_multirun_sweeps_budgets_and_seeds(tmp_path, launcher):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcert.run",
            "-m",
            "budget=0.25,0.5",
            "seed=0,1",
            f"hydra/launcher={launcher}",
            f"results_dir={tmp_path}",
            f"hydra.sweep.dir={tmp_path}/multirun",
            *TINY,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = sorted(p for p in tmp_path.iterdir() if (p / "COMPLETE").exists())
    assert len(runs) == 4
    seen = set()
    for run in runs:
        ex = pd.read_parquet(run / "examples.parquet")
        policy = ex[ex.design != "full"]
        seen.add((float(policy.budget.iloc[0]), int(policy.seed.iloc[0])))
        assert set(policy.design) == {"topk", "randomized"}
    assert seen == {(0.25, 0), (0.25, 1), (0.5, 0), (0.5, 1)}
