"""`make cluster-check`: the same 2-cell budget sweep under Hydra's basic launcher, hydra-submitit-launcher's local
executor (the SLURM code path without the scheduler) and hydra-ray-launcher on a local Ray head started here; the
records of every launcher must equal the basic launcher's.

    python -m kvcert.bench.cluster_check [--install] [--work outputs/cluster_check] [--out results/bench]

--install pip-installs pyproject's `cluster` extra (torch pinned to the installed build, so nothing can pull a CUDA
wheel); a plugin that cannot be installed or imported is reported with the exact error and its launcher is skipped.
The Ray head is started by this script (`ray start --head --block` in its own process group, private temp dir and
free ports) and stopped by killing that process group only. Exit code: 0 when every launcher that ran matched,
1 on a mismatch or a launcher that failed, 2 when even the basic sweep failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# one tiny cell: the packaged model, one example at 500 tokens, 4 new tokens; the sweep is over the budget
CELL = [
    "+debug=smoke",
    "task.tasks=[single_needle]",
    "task.n_examples=1",
    "decode.max_new_tokens=4",
    "threads=1",
    "name=null",
    "hydra/job_logging=disabled",
]
SWEEP = ["budget=0.25,0.5"]
LAUNCHERS = {
    "basic": ["hydra/launcher=basic"],
    # the plugin's own local executor: BaseSubmititLauncher.launch / __call__ exactly as under SLURM (pickled
    # launcher, submitit job folders, results read back), only the sbatch submission is replaced by local processes
    "submitit_local": [
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=30",
        "hydra.launcher.cpus_per_task=1",
    ],
    # our ray_cluster config (address, num_cpus) pointed at the head this script starts
    "ray_cluster": ["hydra/launcher=ray_cluster", "hydra.launcher.ray.remote.num_cpus=1"],
}
PLUGIN_MODULES = {
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "submitit"),
    "ray_cluster": ("hydra_plugins.hydra_ray_launcher", "ray"),
}


def log(msg: str) -> None:
    print(f"[cluster-check] {msg}", flush=True)


def cluster_requirements() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cluster"]


def install_extra() -> dict[str, str]:
    """pip install each requirement of the `cluster` extra; returns {requirement: 'ok' | error text}."""
    import torch

    out = {}
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={torch.__version__.split('+')[0]}\n")
        constraint = f.name
    try:
        for req in cluster_requirements():
            cmd = [sys.executable, "-m", "pip", "install", "-q", "-c", constraint, req]
            res = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in (res.stderr + res.stdout).splitlines() if "is ignored" not in ln and ln.strip()]
            out[req] = "ok" if res.returncode == 0 else "\n".join(lines[-6:])
            log(f"pip install {req}: {out[req]}")
    finally:
        os.unlink(constraint)
    return out


def plugin_problem(launcher: str) -> str | None:
    for mod in PLUGIN_MODULES.get(launcher, ()):
        try:
            importlib.import_module(mod)
        except Exception as err:  # noqa: BLE001  (any import failure is reported verbatim)
            return f"import {mod}: {type(err).__name__}: {err}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayHead:
    """A local Ray head in its own process group (started here, stopped here, nothing else touched)."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.port = _free_port()
        self.temp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # Ray needs a short path for its sockets
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(self.temp) / "head.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> None:
        ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        cmd = [
            ray,
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            "--num-cpus=2",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={self.temp}",
            f"--ray-client-server-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}",
            f"--metrics-export-port={_free_port()}",
            "--object-store-memory=100000000",
        ]
        log(f"starting Ray head: {' '.join(cmd[1:4])} ... (temp dir {self.temp})")
        with open(self.log_path, "w") as head_log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ray start exited with {self.proc.returncode}: "
                    + " | ".join(self.log_path.read_text().splitlines()[-5:])
                )
            res = subprocess.run(
                [ray, "status", f"--address={self.address}"], env=self.env, capture_output=True, text=True, timeout=60
            )
            if res.returncode == 0:
                log(f"Ray head up at {self.address} (pid {self.proc.pid}, process group {self.proc.pid})")
                return
            time.sleep(2)
        raise RuntimeError(f"Ray head not up after {timeout:.0f} s")

    def stop(self) -> list[int]:
        """SIGTERM, then SIGKILL, to the head's own process group; returns pids of that group still alive."""
        if self.proc is None:
            return []
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_pids(pgid):
                time.sleep(0.5)
            if not _group_pids(pgid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        left = _group_pids(pgid)
        shutil.rmtree(self.temp, ignore_errors=True)
        log(f"Ray head stopped (process group {pgid}; {len(left)} process(es) left)")
        return left


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    pids.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def run_sweep(launcher: str, work: Path, env: dict[str, str], extra: list[str], timeout: float) -> dict:
    results_dir, sweep_dir = work / launcher / "runs", work / launcher / "multirun"
    shutil.rmtree(work / launcher, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "kvcert.run",
        "-m",
        *CELL,
        *LAUNCHERS[launcher],
        *extra,
        *SWEEP,
        f"results_dir={results_dir}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    log(f"{launcher}: {' '.join(cmd[2:])}")
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, tail = res.returncode, (res.stdout + res.stderr).strip().splitlines()[-12:]
    except subprocess.TimeoutExpired as err:
        rc, tail = 124, [f"timed out after {timeout:.0f} s", *(str(err.stderr or "").splitlines()[-8:])]
    wall = time.perf_counter() - t0
    folders = sorted(p for p in results_dir.glob("*") if p.is_dir()) if results_dir.exists() else []
    log(f"{launcher}: exit {rc} in {wall:.0f} s, {len(folders)} result folder(s)")
    if rc != 0:
        for line in tail:
            log(f"  | {line}")
    return dict(rc=rc, wall_s=wall, folders=[str(p) for p in folders], tail=tail)


def read_records(folder: Path) -> dict:
    import pandas as pd

    out = {
        "complete": (folder / "COMPLETE").exists(),
        "config": (folder / "config.yaml").read_text() if (folder / "config.yaml").exists() else None,
    }
    for name in ("examples", "steps"):
        path = folder / f"{name}.parquet"
        df = pd.read_parquet(path) if path.exists() else None
        if df is not None:
            keys = [c for c in ("example_id", "variant", "step", "layer", "head") if c in df.columns]
            df = df.sort_values(keys).reset_index(drop=True)
        out[name] = df
    return out


def compare(reference: list[str], other: list[str]) -> tuple[bool, list[str]]:
    """Same folder names, each COMPLETE, same config.yaml, identical examples/steps tables (provenance.json, the
    only file with timestamps, git state and versions, is not compared)."""
    import pandas as pd

    notes = []
    ref = {Path(p).name: Path(p) for p in reference}
    oth = {Path(p).name: Path(p) for p in other}
    if set(ref) != set(oth):
        return False, [f"result folders differ: {sorted(ref)} vs {sorted(oth)}"]
    ok = True
    for name in sorted(ref):
        a, b = read_records(ref[name]), read_records(oth[name])
        if not (a["complete"] and b["complete"]):
            ok = False
            notes.append(f"{name}: COMPLETE missing")
        if a["config"] != b["config"]:
            ok = False
            notes.append(f"{name}: config.yaml differs")
        for table in ("examples", "steps"):
            x, y = a[table], b[table]
            if x is None or y is None:
                ok = False
                notes.append(f"{name}/{table}.parquet missing")
                continue
            try:
                pd.testing.assert_frame_equal(x, y, check_exact=True)
                notes.append(f"{name}/{table}.parquet: identical ({len(x)} rows x {x.shape[1]} columns)")
            except AssertionError as err:
                ok = False
                notes.append(f"{name}/{table}.parquet: differs: {str(err).splitlines()[0:3]}")
    return ok, notes


def launcher_table(rows: list[list[str]]) -> str:
    """cluster_check.md: one row per launcher (kvcert.analysis.tables.markdown_table, cells written as given)."""
    import pandas as pd  # here: this module runs before the cluster extra is installed

    from kvcert.analysis.tables import markdown_table

    return markdown_table(
        pd.DataFrame(rows, columns=["launcher", "outcome", "wall (s)", "detail"]), parse_numbers=False
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcert.bench.cluster_check", description=__doc__.splitlines()[0])
    ap.add_argument("--install", action="store_true", help="pip install pyproject's cluster extra first")
    ap.add_argument("--work", default="outputs/cluster_check", help="sweep outputs (removed and rewritten)")
    ap.add_argument("--out", default="results/bench", help="where cluster_check.{json,md} go")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated subset")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launcher sweep")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    work = (ROOT / args.work).resolve() if not Path(args.work).is_absolute() else Path(args.work)
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    report: dict = {"python": sys.version.split()[0], "cell": CELL, "sweep": SWEEP, "launchers": {}}
    if args.install:
        report["install"] = install_extra()
    import importlib.metadata as md

    versions = {}
    for dist in ("hydra-core", "hydra-submitit-launcher", "submitit", "hydra-ray-launcher", "ray"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    report["versions"] = versions
    log("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    wanted = [x for x in args.launchers.split(",") if x]
    if "basic" not in wanted:
        wanted.insert(0, "basic")
    status = 0
    for launcher in wanted:
        entry: dict = {}
        report["launchers"][launcher] = entry
        problem = plugin_problem(launcher)
        if problem:
            entry.update(status="skipped", reason=problem)
            log(f"{launcher}: SKIPPED ({problem})")
            continue
        head = None
        extra: list[str] = []
        try:
            if launcher == "ray_cluster":
                head = RayHead(env)
                head.start()
                extra = [f"hydra.launcher.ray.init.address={head.address}"]
            entry.update(run_sweep(launcher, work, env, extra, args.timeout))
        except Exception as err:  # noqa: BLE001
            entry.update(rc=1, error=f"{type(err).__name__}: {err}")
            log(f"{launcher}: ERROR {entry['error']}")
        finally:
            if head is not None:
                entry["ray_left_running"] = head.stop()
        if entry.get("rc") != 0:
            entry["status"] = "failed"
            status = 2 if launcher == "basic" else max(status, 1)
            continue
        if launcher == "basic":
            entry["status"] = "ok" if len(entry["folders"]) == 2 else "failed"
            if entry["status"] != "ok":
                status = 2
            continue
        ref = report["launchers"]["basic"]
        if ref.get("status") != "ok":
            entry["status"] = "not compared (basic failed)"
            continue
        same, notes = compare(ref["folders"], entry["folders"])
        entry.update(status="match" if same else "MISMATCH", notes=notes)
        for n in notes:
            log(f"  {launcher}: {n}")
        log(f"{launcher}: records {'equal those of basic' if same else 'DIFFER from basic'}")
        status = status if same else max(status, 1)
    report["wall_s"] = time.perf_counter() - t_start
    report["exit_code"] = status
    out = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    rows = []
    for name, e in report["launchers"].items():
        detail = (
            e.get("reason")
            or e.get("error")
            or ("; ".join(e.get("tail", [])[-2:]) if e.get("rc") else f"{len(e.get('folders', []))} result folders")
        )
        rows.append([f"{name}", f"{e.get('status')}", f"{e.get('wall_s', 0):.0f}", f"{detail}"])
    table = launcher_table(rows)
    (out / "cluster_check.md").write_text(table + "\n")
    print(table)
    log(f"done in {report['wall_s']:.0f} s, exit {status}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
