"""The pinned environment: requirements.lock pins what the studies locked and everything pyproject asks for, and
`prereg verify` names every installed package that differs from it, with the fix."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

from kvcert import prereg

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return prereg._normalized(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])


def test_lock_pins_the_versions_study2_locked():
    pins = prereg.pinned_environment(ROOT)
    locked = json.loads((ROOT / "preregistration/study2/LOCK.json").read_text())["packages"]
    assert locked, "study 2's lock records package versions"
    for package, version in locked.items():
        assert pins[prereg._normalized(package)] == version, package


def test_lock_pins_every_dependency_and_the_packaged_data():
    pins = prereg.pinned_environment(ROOT)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    data = [line for line in (ROOT / "requirements/data.txt").read_text().splitlines() if "==" in line]
    assert data, "requirements/data.txt names the packaged model and text"
    missing = [r for r in [*wanted, *data] if _name(r) not in pins]
    assert not missing, f"not pinned in requirements.lock: {missing}"
    for line in data:  # the data's exact pins are carried over
        name, version = line.split("==")
        assert pins[prereg._normalized(name)] == version.strip()
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", v) for v in pins.values()), "every pin is an exact version"


def test_constraints_agree_with_the_lock():
    pins = prereg.pinned_environment(ROOT)
    for line in (ROOT / "requirements/constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            assert pins[prereg._normalized(name)].split("+")[0] == version.strip(), name


def _tree_with_lock(tmp_path: Path, lock_text: str) -> Path:
    (tmp_path / "preregistration").mkdir()
    (tmp_path / "preregistration/predictions.yaml").write_text("claims: {}\n")
    (tmp_path / "preregistration/PREREGISTRATION.md").write_text("# plan\n")
    (tmp_path / "requirements.lock").write_text(lock_text)
    prereg.lock(tmp_path)
    return tmp_path


def test_mismatches_name_the_package_the_versions_and_absence(tmp_path):
    numpy = metadata.version("numpy")
    root = _tree_with_lock(
        tmp_path,
        f"# header\nnumpy=={numpy}\n    # via pandas\npandas==0.0.1\nno-such-package-kvcert==1.0\n--no-deps\n",
    )
    assert prereg.pinned_environment(root) == {"numpy": numpy, "pandas": "0.0.1", "no-such-package-kvcert": "1.0"}
    drift = prereg.environment_mismatches(root)
    assert drift == [
        "no-such-package-kvcert not installed (requirements.lock pins 1.0)",
        f"pandas {metadata.version('pandas')} installed, requirements.lock pins 0.0.1",
    ]
    assert prereg.verify(root)["environment"] == drift


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcert.prereg", *args], capture_output=True, text=True)


def test_verify_refuses_a_drifted_environment_with_the_fix(tmp_path):
    root = _tree_with_lock(tmp_path, "pandas==0.0.1\n")
    refused = _cli("verify", "--root", str(root))
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "pandas" in line and "requirements.lock pins 0.0.1" in line and "make install" in line
    allowed = _cli("verify", "--root", str(root), "--allow-environment-drift")
    assert allowed.returncode == 0 and allowed.stderr.startswith("warning:")


def test_matching_environment_passes(tmp_path):
    root = _tree_with_lock(tmp_path, f"pandas=={metadata.version('pandas')}\n")
    assert prereg.environment_mismatches(root) == []
    assert _cli("verify", "--root", str(root)).returncode == 0


def test_this_checkout_matches_its_lock():
    """make install / CI install requirements.lock exactly; a mismatch here means the install step drifted."""
    assert prereg.environment_mismatches(ROOT) == []


# ---------------------------------------------------------------- make VENV=<another checkout's environment>
def _venv_guard():
    import importlib.util

    spec = importlib.util.spec_from_file_location("venv_guard", ROOT / "requirements/venv_guard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_venv(path: Path, direct_url: dict | None) -> Path:
    """A folder laid out like a virtual environment with kvcert's PEP 610 record (direct_url.json) in it."""
    info = path / "lib/python3.11/site-packages/kvcert-0.1.0.dist-info"
    info.mkdir(parents=True)
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return path


def _editable(folder: Path) -> dict:
    return {"dir_info": {"editable": True}, "url": folder.resolve().as_uri()}


def test_venv_guard_refuses_an_environment_installed_editable_from_another_checkout(tmp_path):
    guard = _venv_guard()
    here, other = tmp_path / "clone", tmp_path / "main checkout"
    here.mkdir()
    other.mkdir()
    venv = _fake_venv(other / ".venv", _editable(other))
    assert guard.editable_source(venv) == other.resolve()
    message = guard.refusal(str(venv), here)
    assert message is not None and "\n" not in message
    assert message.startswith(f"error: VENV={venv} has kvcert installed editable from {other.resolve()}")
    assert f"run make in {other.resolve()}" in message and "make VENV=.venv" in message
    # the checkout's own environment, wherever its kvcert points (a copied checkout reinstalls into its own)
    assert guard.refusal(".venv", other) is None
    assert guard.refusal(str(_fake_venv(here / "env", _editable(other))), here) is None
    # installed editable from this checkout, or from one that is gone; not installed; installed from a wheel
    assert guard.refusal(str(_fake_venv(tmp_path / "a", _editable(here))), here) is None
    gone = tmp_path / "deleted clone"
    gone.mkdir()
    stale = _fake_venv(tmp_path / "b", _editable(gone))
    gone.rmdir()
    assert guard.refusal(str(stale), here) is None
    assert guard.refusal(str(tmp_path / "no-venv-yet"), here) is None
    assert guard.refusal(str(_fake_venv(tmp_path / "c", None)), here) is None
    wheel = {"archive_info": {}, "url": (tmp_path / "kvcert-0.1.0-py3-none-any.whl").as_uri()}
    assert guard.refusal(str(_fake_venv(tmp_path / "d", wheel)), here) is None
    broken = _fake_venv(tmp_path / "e", None)
    (next(broken.rglob("*.dist-info")) / "direct_url.json").write_text("not json")
    assert guard.refusal(str(broken), here) is None


def test_make_refuses_another_checkouts_environment_before_touching_it(tmp_path):
    import shutil

    if shutil.which("make") is None or sys.version_info[:2] != (3, 11):
        pytest.skip("needs make and CPython 3.11 (the Makefile's checks)")
    other = tmp_path / "other checkout"
    other.mkdir()
    venv = _fake_venv(tmp_path / "other-venv", _editable(other))
    record = next(venv.rglob("direct_url.json"))
    before = record.read_bytes()
    # PY=false: should the guard ever let the rule through, nothing can be installed into the fake environment
    make = ["make", "--no-print-directory", f"VENV={venv}", f"PYTHON={sys.executable}", "PY=false", "install"]
    done = subprocess.run(make, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.splitlines()[0].startswith(f"error: VENV={venv} has kvcert installed editable from {other}")
    assert record.read_bytes() == before and not (venv / ".installed").exists()
    dry = subprocess.run([*make[:-2], "-n", "install"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = dry.stdout.splitlines()
    guard = next(i for i, line in enumerate(lines) if "requirements/venv_guard.py" in line)
    assert guard < next(i for i, line in enumerate(lines) if "rm -rf" in line)  # before anything is removed
