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


def _wrapper(path, seconds: float, heartbeat: float | None = None):
    """`python -m kvcert.studies.walltime study4 -- <sleep seconds>` in its own process, recording into `path`."""
    import os
    import subprocess

    sleeper = [sys.executable, "-c", f"import time; time.sleep({seconds})"]
    code = "\n".join([
        "import sys",
        "from pathlib import Path",
        "from kvcert.studies import walltime",
        f"walltime.PROVENANCE = Path({str(path)!r})",
        f"walltime.HEARTBEAT_S = {heartbeat or walltime.HEARTBEAT_S}",
        f"sys.exit(walltime.main(['study4', '--', *{sleeper!r}]))",
    ])  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ})


def test_a_step_stopped_by_sigterm_is_recorded_with_its_exit_code(tmp_path):
    """SIGTERM to the wrapper (a scheduler, a session's end) stops the command and records the time it ran, exit
    code 143; the file stays valid JSON."""
    import signal
    import time

    path = tmp_path / "results/provenance.json"
    proc = _wrapper(path, 60)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    (entry,) = json.loads(path.read_text())[walltime.KEY]["study4"]
    assert entry["exit_code"] == 143 and 2 < entry["seconds"] < 30


def test_a_killed_step_keeps_the_seconds_of_its_last_rewrite(tmp_path, monkeypatch):
    """SIGKILL to the wrapper (a session's end) stops nothing cleanly: the entry written while the step ran stays,
    exit code null, with the seconds up to its last rewrite; a step that ends replaces its own entry, not another's."""
    import signal
    import time

    path = tmp_path / "results/provenance.json"
    proc = _wrapper(path, 8, heartbeat=0.3)
    deadline = time.monotonic() + 20  # until a rewrite has happened (the wrapper's start imports kvcert)
    while time.monotonic() < deadline and not (path.is_file() and '"seconds": 0.0' not in path.read_text()):
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    (entry,) = json.loads(path.read_text())[walltime.KEY]["study4"]
    assert entry["exit_code"] is None and 0.2 < entry["seconds"] < 8
    assert walltime.totals(path)["study4"] == entry["seconds"]
    # a resumed step adds its own entry beside the killed one (the orphaned sleeper ends by itself)
    monkeypatch.setattr(walltime, "PROVENANCE", path)
    assert walltime.main(["study4", "--", sys.executable, "-c", "pass"]) == 0
    entries = json.loads(path.read_text())[walltime.KEY]["study4"]
    assert [e["exit_code"] for e in entries] == [None, 0] and entries[0]["step"] != entries[1]["step"]


def test_elapsed_counts_side_by_side_steps_once_and_a_gap_not_at_all(tmp_path, capsys, monkeypatch):
    """Two steps side by side (10:00-11:00 and 10:30-12:00), a resumption after a gap (13:00-13:30), and a step before
    --since: elapsed is the union (2.5 h), totals the per-study sums; a bad --since is one line naming the fix."""

    def entry(start_h: float, end_h: float) -> dict:
        end = f"2026-12-06T{int(end_h):02d}:{int(end_h % 1 * 60):02d}:00+00:00"
        return {"seconds": (end_h - start_h) * 3600, "finished": end}

    path = tmp_path / "provenance.json"
    steps = {"study4": [entry(10, 11), entry(13, 13.5)], "study5": [entry(10.5, 12)], "study1": [entry(8, 9)]}
    path.write_text(json.dumps({walltime.KEY: steps}))
    since = "2026-12-06T09:30"
    assert walltime.elapsed(path, since) == 2.5 * 3600
    assert walltime.totals(path, since) == {"study4": 1.5 * 3600, "study5": 1.5 * 3600}  # study1 began before
    assert walltime.elapsed(path) == 3.5 * 3600 and walltime.totals(path)["study1"] == 3600
    monkeypatch.setattr(walltime, "PROVENANCE", path)
    assert walltime.main(["totals", "--since", since]) == 0
    assert "elapsed since 2026-12-06T09:30: 9,000 s (2.50 h" in capsys.readouterr().out
    assert walltime.main(["totals", "--since", "yesterday"]) == 2
    assert "give an ISO time such as" in capsys.readouterr().err
