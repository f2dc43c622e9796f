"""Installed, not only checked out: the wheel ships conf/ as package data (src/kvcert/conf links to ../../conf),
the runner reads the packaged copy when there is no checkout, a user's own config folder joins through Hydra's
search path (`hydra.searchpath=[file:///path/to/my_conf]`), and a wheel built from a clone carries the compiled decode
kernel (setup.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import needs_cxx

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the project (so the checkout gets no build/ folder)."""
    tmp = tmp_path_factory.mktemp("wheel")
    project = tmp / "project"
    project.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "_decode_attention*")  # no kernel built in place
    shutil.copytree(ROOT / "src", project / "src", symlinks=True, ignore=ignore)  # keeps the conf link relative
    shutil.copytree(ROOT / "conf", project / "conf")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copy(ROOT / "setup.py", project / "setup.py")
    out = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(project), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "KVCERT_BUILD_KERNEL": "0"},  # the configs only: the kernel's build has its own test
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


@pytest.mark.slow
@needs_cxx
def test_a_wheel_from_a_fresh_clone_carries_the_compiled_kernel(tmp_path: Path) -> None:
    """`pip wheel --no-build-isolation --no-deps .` from a fresh clone compiles the decode kernel into the wheel
    (setup.py), with the record of what it was built for; installed, kvcert imports it and builds nothing."""
    from kvcert.hf import kernel

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a checkout")
    clone, out, site = tmp_path / "clone", tmp_path / "dist", tmp_path / "site"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k != "KVCERT_BUILD_KERNEL"}
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v", "-w", str(out), str(clone)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = zipfile.ZipFile(next(out.glob("kvcert-*.whl")))
    names = set(wheel.namelist())
    assert f"kvcert/hf/_decode_attention{sysconfig.get_config_var('EXT_SUFFIX')}" in names, sorted(names)[:20]
    record = json.loads(wheel.read("kvcert/hf/_decode_attention.json"))
    source = (clone / "src" / "kvcert" / "hf" / "csrc" / "decode_attention.cpp").read_bytes()
    here = kernel.build_record()
    assert record["source_sha256"] == hashlib.sha256(source).hexdigest()
    assert (record["cflags"], record["ldflags"]) == (" ".join(kernel.CFLAGS), " ".join(kernel.LDFLAGS))
    for key in ("cpu_sha256", "torch", "python"):  # built for this machine, this torch and this Python
        assert record[key] == here[key], key
    wheel.extractall(site)
    probe = (
        "import torch.utils.cpp_extension as c\n"
        "def refuse(*a, **k): raise SystemExit('kernel() built the extension')\n"
        "c.load = refuse\n"
        "from kvcert.hf import kernel\n"
        "print(kernel.kernel().__file__)\n"
    )
    env = {**env, "PYTHONPATH": str(site), "TORCH_EXTENSIONS_DIR": str(tmp_path / "jit")}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()).parent == site / "kvcert" / "hf" and not (tmp_path / "jit").exists()
