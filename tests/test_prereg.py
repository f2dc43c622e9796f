"""Lock, verify, deviations and the CLI on a small copy of the pre-registered tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcert import prereg

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """predictions, plan, two claim configs and two analysis modules, laid out like the repository."""
    files = {
        "preregistration/predictions.yaml": "claims: {C1: {threshold: 0.95}}\n",
        "preregistration/PREREGISTRATION.md": "# plan\n",
        "preregistration/DEVIATIONS.md": (ROOT / "preregistration" / "DEVIATIONS.md").read_text(),
        "conf/claim/c1.yaml": "budget: [0.25, 0.5]\n",
        "conf/claim/c2.yaml": "budget: [0.5]\n",
        "src/kvcert/analysis/coverage.py": "X = 1\n",
        "src/kvcert/analysis/claims.py": "Y = 2\n",
        "src/kvcert/run.py": "not locked\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_lock_covers_the_pre_registered_files_only(tree):
    record = prereg.lock(tree)
    assert sorted(record["files"]) == [
        "conf/claim/c1.yaml",
        "conf/claim/c2.yaml",
        "preregistration/PREREGISTRATION.md",
        "preregistration/predictions.yaml",
        "src/kvcert/analysis/claims.py",
        "src/kvcert/analysis/coverage.py",
    ]
    on_disk = json.loads((tree / prereg.LOCK_PATH).read_text())
    assert on_disk["files"] == record["files"] and "created" in on_disk and "git_commit" in on_disk
    assert prereg.verify(tree)["status"] == "verified"
    with pytest.raises(FileExistsError):
        prereg.lock(tree)


def test_one_byte_changed_is_a_named_deviation(tree):
    prereg.lock(tree)
    path = tree / "conf/claim/c1.yaml"
    path.write_bytes(path.read_bytes().replace(b"0.25", b"0.26"))
    res = prereg.verify(tree)
    assert res["status"] == "deviates" and res["changed"] == ["conf/claim/c1.yaml"]
    assert res["deviations_recorded"] is False and res["unrecorded"] == ["conf/claim/c1.yaml"]
    with (tree / prereg.DEVIATIONS_PATH).open("a") as fh:
        fh.write("\n### 2026-01-02 conf/claim/c1.yaml\nbudget 0.25 -> 0.26, before seeing results\n")
    assert prereg.verify(tree)["deviations_recorded"] is True


def test_missing_and_added_files(tree):
    prereg.lock(tree)
    (tree / "src/kvcert/analysis/claims.py").unlink()
    (tree / "src/kvcert/analysis/extra.py").write_text("Z = 3\n")
    res = prereg.verify(tree)
    assert res["status"] == "deviates"
    assert res["missing"] == ["src/kvcert/analysis/claims.py"] and res["added"] == ["src/kvcert/analysis/extra.py"]
    assert res["changed"] == []


def test_template_examples_do_not_count_as_recorded(tree):
    prereg.lock(tree)
    (tree / "preregistration/predictions.yaml").write_text("claims: {}\n")
    assert prereg.verify(tree)["deviations_recorded"] is False


def test_unlocked_tree(tree):
    assert prereg.verify(tree)["status"] == "unlocked"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcert.prereg", *args],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )


def test_cli_exit_codes(tree):
    assert _cli("verify", "--root", str(tree)).returncode == 1  # not locked yet
    assert _cli("lock", "--root", str(tree)).returncode == 0
    assert _cli("lock", "--root", str(tree)).returncode == 1  # refuses to re-lock
    assert _cli("verify", "--root", str(tree)).returncode == 0
    (tree / "preregistration/PREREGISTRATION.md").write_text("# plan, edited\n")
    failed = _cli("verify", "--root", str(tree))
    assert failed.returncode == 1
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and "preregistration/PREREGISTRATION.md" in lines[0]
    refused = _cli("verify", "--allow-deviations", "--root", str(tree))  # unrecorded: refused, whatever the flag
    assert refused.returncode == 1 and "record it in preregistration/DEVIATIONS.md" in refused.stderr
    deviations = tree / "preregistration/DEVIATIONS.md"
    previous = deviations.read_text() if deviations.exists() else "# Deviations\n\n## Log\n"
    deviations.write_text(previous + "\n### 2026-12-03 preregistration/PREREGISTRATION.md\n- what: an edit\n")
    allowed = _cli("verify", "--root", str(tree))
    assert allowed.returncode == 0 and allowed.stderr.startswith("warning:")
    assert _cli("verify", "--strict", "--root", str(tree)).returncode == 1


def test_repository_files_exist_for_the_lock():
    for rel in prereg.LOCKED_FILES:
        assert (ROOT / rel).is_file(), rel


def test_study2_lock_is_wider_and_records_package_versions(tree, monkeypatch):
    """Study 2's lock covers the runner, records, configs and code that study 1's did not, and the installed
    versions of the packages that compute or ship the data; study 1's lock is untouched by it."""
    (tree / "preregistration/study2").mkdir(parents=True)
    (tree / "preregistration/study2/predictions.yaml").write_text("claims: {}\n")
    (tree / "preregistration/study2/PLAN.md").write_text("# plan 2\n")
    (tree / "preregistration/study2/conformal_by_layer.csv").write_text("layer,multiplier_tight\n0,1.1\n")
    (tree / "conf/model").mkdir(parents=True)
    (tree / "conf/model/smollm2.yaml").write_text("name: smollm2\n")
    prereg.lock(tree)
    versions = {"torch": "2.13.0", "transformers": "5.24.0"}
    monkeypatch.setattr(prereg, "package_versions", lambda study="study1": dict(versions) if study == "study2" else {})
    record = prereg.lock(tree, study="study2")
    assert {"src/kvcert/run.py", "conf/model/smollm2.yaml", "src/kvcert/analysis/claims.py"} <= set(record["files"])
    assert "src/kvcert/run.py" not in prereg.locked_files(tree)  # study 1's lock stays as it was
    assert record["packages"] == versions
    assert prereg.verify(tree, "study2")["status"] == "verified"
    (tree / "src/kvcert/run.py").write_text("edited\n")
    versions["torch"] = "2.14.1"
    res = prereg.verify(tree, "study2")
    assert res["changed"] == ["src/kvcert/run.py", "package:torch"] and not res["deviations_recorded"]
    assert prereg.verify(tree)["status"] == "verified"
    (tree / "preregistration/study2/DEVIATIONS.md").write_text("## Log\n### x src/kvcert/run.py package:torch\n")
    assert prereg.verify(tree, "study2")["deviations_recorded"]
    with pytest.raises(ValueError, match="unknown study"):
        prereg.verify(tree, "study9")


def test_verify_prints_one_line_per_study_and_the_paths_on_request(tree):
    """A deviating study's check is one line (how many items, whether all are recorded, where to read them), however
    many files differ; an unrecorded file is named in it; --list prints every item, one per line, on stdout."""
    assert _cli("lock", "--root", str(tree)).returncode == 0
    edited = ["conf/claim/c1.yaml", "conf/claim/c2.yaml", "src/kvcert/analysis/coverage.py"]
    for rel in edited:
        (tree / rel).write_text("edited\n")
    (tree / "src/kvcert/analysis/claims.py").unlink()
    (tree / "src/kvcert/analysis/extra.py").write_text("Z = 3\n")
    deviations = tree / "preregistration/DEVIATIONS.md"
    recorded = [*edited, "src/kvcert/analysis/claims.py"]  # extra.py is left unrecorded
    deviations.write_text(deviations.read_text() + f"\n### 2026-12-06 {' '.join(recorded)}\n- what: edits\n")

    failed = _cli("verify", "--root", str(tree))
    (line,) = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and line.startswith("error: pre-registration (study1) deviates: 5 items differ")
    assert "(3 changed, 1 missing, 1 added)" in line
    assert "1 not recorded in preregistration/DEVIATIONS.md: src/kvcert/analysis/extra.py" in line
    assert "conf/claim/c1.yaml" not in line and "verify --study study1 --list" in line

    listed = _cli("verify", "--list", "--root", str(tree))
    assert listed.stdout.splitlines() == [
        "changed conf/claim/c1.yaml",
        "changed conf/claim/c2.yaml",
        "changed src/kvcert/analysis/coverage.py",
        "missing src/kvcert/analysis/claims.py",
        "added   src/kvcert/analysis/extra.py  NOT RECORDED",
    ]
    assert listed.returncode == 1 and len(listed.stderr.strip().splitlines()) == 1

    deviations.write_text(deviations.read_text() + "\n### 2026-12-07 src/kvcert/analysis/extra.py\n- what: new\n")
    allowed = _cli("verify", "--root", str(tree))
    (line,) = allowed.stderr.strip().splitlines()
    assert allowed.returncode == 0 and line.startswith("warning: pre-registration (study1) deviates: 5 items")
    assert "all recorded in preregistration/DEVIATIONS.md" in line and "extra.py" not in line
    assert (
        _cli("verify", "--list", "--root", str(tree)).stdout.splitlines()[-1] == "added   src/kvcert/analysis/extra.py"
    )
