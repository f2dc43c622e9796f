"""`make reproduce`'s regeneration jobs on however many cores the machine has:

    python -m kvcert.studies.schedule [--cores N] [--dry-run]

The jobs (study 1; studies 3, 4 and 5 once per model; study 2) read none of each other's records, so they can run
side by side. Each pins its own thread count (study 2: 2, its PLAN.md D4; the others: 1). The scheduler starts them
longest first, each as soon as its threads fit in the cores left free; a job needing more threads than the machine
has starts when nothing else runs. On 2 cores that is two single-thread jobs at a time and study 2 last; on 9 or more
every job at once, and the run takes as long as its longest job.

Each job runs under `kvcert.studies.walltime` (its wall seconds in results/provenance.json), its output appended to
outputs/reproduce/<job>.log, and the scheduler prints one line per start and finish. A failed job lets the running
ones finish and starts no new one; the scheduler then exits non-zero naming it. Every job resumes from its records,
so rerunning after a kill picks up where each stopped. Memory: each job holds one model (about 1-3 GB).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LOGS = Path("outputs/reproduce")


@dataclass(frozen=True)
class Job:
    name: str
    study: str  # its key in results/provenance.json
    args: tuple[str, ...]  # after the Python executable
    threads: int
    estimate_s: float  # the run on the final code, Intel Xeon, 1 thread per job, two side by side (study 2: 2 threads)


JOBS = (
    Job("study1", "study1", ("-m", "kvcert.reproduce", "run", "--study", "study1"), 1, 1_700),
    Job("study2", "study2", ("-m", "kvcert.reproduce", "run", "--study", "study2"), 2, 4_400),
    Job("study3_smollm2", "study3", ("-m", "kvcert.reproduce", "run", "--study", "study3_smollm2"), 1, 2_300),
    Job("study3_gemma3", "study3", ("-m", "kvcert.reproduce", "run", "--study", "study3_gemma3"), 1, 2_150),
    *(
        Job(
            f"study{n}_{model}",
            f"study{n}",
            ("-m", f"kvcert.studies.study{n}", "run", "--model", model, "--regenerate"),
            1,
            estimate,
        )  # fmt: skip
        for n, model, estimate in (
            (4, "smollm2", 4_650),
            (4, "gemma3", 4_700),
            (5, "smollm2", 3_550),
            (5, "gemma3", 3_900),
        )
    ),
)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def command(job: Job, python: str = sys.executable) -> list[str]:
    """The job under `kvcert.studies.walltime`, as `make reproduce` records it."""
    return [python, "-m", "kvcert.studies.walltime", job.study, "--", python, *job.args]


def _startable(pending: list[Job], busy: int, cores: int) -> list[Job]:
    """The pending jobs (longest first) to start now, `busy` of the `cores` in use: each whose threads fit in what is
    left after the ones before it (a job wider than the machine counts as the whole machine)."""
    out, free = [], cores - busy
    for job in pending:
        if min(job.threads, cores) <= free:
            out.append(job)
            free -= min(job.threads, cores)
    return out


def plan(jobs: tuple[Job, ...] | list[Job], cores: int) -> tuple[list[tuple[float, Job]], float]:
    """(each job's start in estimated seconds, the run's estimated wall seconds) under the rule `run` follows."""
    pending = sorted(jobs, key=lambda j: -j.estimate_s)
    running: list[tuple[float, Job]] = []  # (estimated end, job)
    starts, now = [], 0.0
    while pending or running:
        for job in _startable(pending, sum(min(j.threads, cores) for _, j in running), cores):
            pending.remove(job)
            running.append((now + job.estimate_s, job))
            starts.append((now, job))
        now = min(end for end, _ in running)
        running = [(end, job) for end, job in running if end > now]
    return starts, now


def run(
    jobs: tuple[Job, ...] | list[Job],
    cores: int,
    launch: Callable[[Job], subprocess.Popen],
    *,
    poll_s: float = 1.0,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Run every job, longest first, at most `cores` threads at a time; returns the names of the failed jobs (a
    failure starts no new job; the running ones finish)."""
    pending = sorted(jobs, key=lambda j: -j.estimate_s)
    running: dict[str, tuple[Job, subprocess.Popen, float]] = {}
    failed: list[str] = []
    while pending or running:
        busy = sum(min(job.threads, cores) for job, _, _ in running.values())
        for job in _startable(pending, busy, cores) if not failed else []:
            pending.remove(job)
            running[job.name] = (job, launch(job), time.monotonic())
            say(f"[reproduce] start {job.name} ({job.threads} thread{'s' * (job.threads > 1)})")
        if failed and not running:
            break
        for name, (_job, proc, started) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[name]
            say(f"[reproduce] {'done' if code == 0 else 'FAILED'} {name}: {time.monotonic() - started:,.0f} s, "
                f"exit {code}")  # fmt: skip
            if code != 0:
                failed.append(name)
        if running:
            time.sleep(poll_s)
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores", type=int, default=None, help="cores to use (default: every core of this machine)")
    ap.add_argument(
        "--dry-run", action="store_true", help="print when each job would start, and the estimated wall time"
    )
    args = ap.parse_args(argv)
    cores = args.cores or available_cores()
    if cores < 1:
        raise SystemExit(f"error: --cores {cores}: give at least 1")
    if args.dry_run:
        starts, wall = plan(JOBS, cores)
        for start, job in starts:
            hours = f"{job.threads} thread(s), about {job.estimate_s / 3600:.1f} h"
            print(f"at {start / 3600:4.1f} h: {job.name} ({hours}): {' '.join(command(job))}")
        print(f"about {wall / 3600:.1f} h on {cores} core(s), from the estimates (Intel Xeon, 1 thread per job)")
        return 0
    LOGS.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []

    def launch(job: Job) -> subprocess.Popen:
        log = open(LOGS / f"{job.name}.log", "a")  # noqa: SIM115 (closed with the process, by the OS)
        proc = subprocess.Popen(command(job), stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    def stop(signum, _frame) -> None:  # a kill of make reproduce stops every job (each records its wall time)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"[reproduce] {len(JOBS)} jobs on {cores} core(s); their output in {LOGS}/<job>.log")
    failed = run(JOBS, cores, launch)
    if failed:
        print(f"error: {', '.join(failed)} failed: see {LOGS}/<job>.log, fix, and rerun (every job resumes)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
