"""make reproduce's wall-time record (kvcert.studies.walltime)."""

from __future__ import annotations

import json
import sys

from kvcert.studies import walltime


def test_a_timed_step_passes_its_exit_code_through_and_appends_its_seconds(tmp_path, monkeypatch):
    """Each step appends one entry under its study (a resumed step adds another; totals sums them); the command's
    exit code is the wrapper's, a failing step is recorded too, and the file's other keys are kept."""
    path = tmp_path / "results/provenance.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"python": "3.11.7"}))
    monkeypatch.setattr(walltime, "PROVENANCE", path)
    ok = [sys.executable, "-c", "import time; time.sleep(0.3)"]
    assert walltime.main(["study4", "--", *ok]) == 0
    assert walltime.main(["study4", "--", *ok]) == 0
    assert walltime.main(["study5", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    data = json.loads(path.read_text())
    assert data["python"] == "3.11.7"
    steps = data[walltime.KEY]
    assert [e["exit_code"] for e in steps["study4"]] == [0, 0] and steps["study5"][0]["exit_code"] == 3
    assert all(0.3 <= e["seconds"] < 30 for e in steps["study4"]) and steps["study4"][0]["cpu"]
    assert steps["study4"][0]["commit"] == walltime._commit()  # the checkout the step started with
    totals = walltime.totals()
    assert totals["study4"] == round(sum(e["seconds"] for e in steps["study4"]), 1) >= 0.6
    assert walltime.main(["study4", "python"]) == 2  # no "--": the usage line, nothing run or recorded
    assert len(json.loads(path.read_text())[walltime.KEY]["study4"]) == 2
