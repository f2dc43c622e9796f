"""Installed, not only checked out: the wheel ships conf/ as package data (src/kvcert/conf links to ../../conf),
the runner reads the packaged copy when there is no checkout, and a user's own config folder joins through Hydra's
search path (`hydra.searchpath=[file:///path/to/my_conf]`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the project (so the checkout gets no build/ folder)."""
    tmp = tmp_path_factory.mktemp("wheel")
    project = tmp / "project"
    project.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", project / "src", symlinks=True, ignore=ignore)  # keeps the conf link relative
    shutil.copytree(ROOT / "conf", project / "conf")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    out = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(project), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("kvcert-*.whl"))


def test_the_wheel_ships_every_config(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"kvcert/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert {"kvcert/conf/config.yaml", "kvcert/conf/model/smollm2.yaml", "kvcert/conf/task/jsonl.yaml"} <= expected
    assert expected <= names, sorted(expected - names)


def test_installed_runner_composes_the_packaged_config_and_a_users_search_path(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "venv" / "lib" / "site-packages"  # no pyproject.toml above it: not a checkout
    zipfile.ZipFile(wheel).extractall(site)
    mine = tmp_path / "my_conf" / "model"
    mine.mkdir(parents=True)
    (mine / "my_model.yaml").write_text("name: /models/mine\ndtype: bfloat16\ncache_dir: null\n")
    env = {**os.environ, "PYTHONPATH": str(site)}  # before the checkout's editable path
    probe = "import kvcert.run as r; print(r.__file__); print(r.config_dir())"
    where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    module, conf = where.stdout.split()
    assert Path(module).is_relative_to(site) and Path(conf) == site / "kvcert" / "conf", where.stderr[-2000:]
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcert.run",
            f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]",
            "model=my_model",
            "task=single_needle",
            "--cfg",
            "job",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-2000:]
    cfg = yaml.safe_load(job.stdout)
    assert cfg["model"] == {"name": "/models/mine", "dtype": "bfloat16", "cache_dir": None, "prompt_format": "auto"}
    assert cfg["task"]["tasks"] == ["single_needle"] and cfg["policy"]["name"] == "main"  # the packaged groups


def test_a_checkout_reads_its_own_conf() -> None:
    from kvcert.run import config_dir

    assert config_dir() == ROOT / "conf"
    assert (ROOT / "src" / "kvcert" / "conf").resolve() == (ROOT / "conf").resolve()
