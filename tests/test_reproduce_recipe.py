"""make reproduce's recipe, run by make with a stand-in Python that logs each command: a regeneration check that
fails does not stop the other checks, the scorecards and figures or the wall-time totals, and make then fails
naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$RECIPE_LOG"
case "$*" in *"$RECIPE_FAIL"*) exit 1;; esac
exit 0
"""


def run_recipe(tmp_path: Path, fail: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (venv / ".installed").touch()  # newer than the lock and sources: make does not install
    log = tmp_path / "log"
    env = {**os.environ, "RECIPE_LOG": str(log), "RECIPE_FAIL": fail}
    out = subprocess.run(["make", "-C", str(ROOT), f"VENV={venv}", "reproduce"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    return out, log.read_text().splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_failed_check_stops_nothing_after_it_and_fails_the_run_by_name(tmp_path):
    out, commands = run_recipe(tmp_path, "study4 regenerate-check")
    assert out.returncode != 0
    assert "make reproduce: regeneration outside the locked tolerances (or not checked) for: study4;" in out.stderr
    order = [next(i for i, c in enumerate(commands) if part in c) for part in (
        "kvcert.studies.schedule", "regenerate full --study all", "study4 regenerate-check",
        "study5 regenerate-check", "kvcert.reproduce analyze --study all", "walltime totals --since 20")]  # fmt: skip
    assert order == sorted(order)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_check_passing_passes_and_a_failed_analysis_stops_the_run(tmp_path):
    out, commands = run_recipe(tmp_path, "no command matches this")
    assert out.returncode == 0, out.stderr
    assert "make reproduce:" not in out.stderr and any("walltime totals --since 20" in c for c in commands)
    out, commands = run_recipe(tmp_path / "again", "kvcert.reproduce analyze")
    assert out.returncode != 0 and not any("walltime totals --since 20" in c for c in commands)
