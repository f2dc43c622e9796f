"""make reproduce's scheduler (kvcert.studies.schedule): longest first, never more threads than cores, study 2's
two threads, a failure stops new starts; and a real run of trivial jobs under walltime."""

from __future__ import annotations

import json
import subprocess
import sys

from kvcert.studies import schedule
from kvcert.studies.schedule import Job


class FakeProcess:
    """Finishes after `ticks` polls with `code`; records the threads running beside it at its start."""

    def __init__(self, ticks: int, code: int = 0):
        self.ticks, self.code = ticks, code

    def poll(self):
        self.ticks -= 1
        return self.code if self.ticks <= 0 else None


def simulate(jobs, cores, codes=None):
    started, running_threads, peak = [], {}, [0]
    procs = {}

    def launch(job):
        started.append(job.name)
        running_threads[job.name] = min(job.threads, cores)
        peak[0] = max(peak[0], sum(running_threads.values()))
        procs[job.name] = FakeProcess(int(job.estimate_s), (codes or {}).get(job.name, 0))
        return procs[job.name]

    def say(line):
        name = line.split()[2].rstrip(":")
        if "done" in line or "FAILED" in line:
            running_threads.pop(name)

    failed = schedule.run(jobs, cores, launch, poll_s=0, say=say)
    return started, peak[0], failed


def test_longest_first_and_never_more_threads_than_cores():
    started, peak, failed = simulate(schedule.JOBS, cores=2)
    assert failed == [] and sorted(started) == sorted(j.name for j in schedule.JOBS)
    assert peak <= 2
    # the two longest single-thread jobs start first; study 2 (two threads) waits for a free machine: it runs last
    assert started[:2] == ["study4_gemma3", "study4_smollm2"] and started[-1] == "study2"


def test_every_job_at_once_when_the_cores_allow():
    started, peak, _ = simulate(schedule.JOBS, cores=16)
    assert peak == sum(j.threads for j in schedule.JOBS) == 9 and started[0] == "study4_gemma3"


def test_a_job_wider_than_the_machine_runs_alone():
    jobs = [Job("wide", "s", (), 4, 5), Job("a", "s", (), 1, 3), Job("b", "s", (), 1, 2)]
    started, peak, failed = simulate(jobs, cores=2)
    assert started == ["wide", "a", "b"] and peak == 2 and failed == []


def test_a_failure_starts_no_new_job_and_lets_the_running_finish():
    jobs = [Job("long", "s", (), 1, 10), Job("fails", "s", (), 1, 2), Job("never", "s", (), 1, 1)]
    started, _, failed = simulate(jobs, cores=2, codes={"fails": 3})
    assert failed == ["fails"] and started == ["long", "fails"]


def test_a_real_run_records_each_job_under_walltime(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    jobs = [Job("one", "s1", ("-c", "print('hello from one')"), 1, 2), Job("two", "s2", ("-c", "pass"), 1, 1)]

    def launch(job):
        log = open(tmp_path / f"{job.name}.log", "w")  # noqa: SIM115
        return subprocess.Popen(schedule.command(job, sys.executable), stdout=log, stderr=subprocess.STDOUT)

    lines = []
    assert schedule.run(jobs, 2, launch, poll_s=0.05, say=lines.append) == []
    assert "hello from one" in (tmp_path / "one.log").read_text()
    recorded = json.loads((tmp_path / "results" / "provenance.json").read_text())["reproduce_wall_seconds"]
    assert set(recorded) == {"s1", "s2"} and recorded["s1"][0]["exit_code"] == 0
    assert any(line.startswith("[reproduce] done one:") for line in lines)


def test_the_plan_follows_the_same_rule_and_bounds_the_wall_time():
    starts, wall = schedule.plan(schedule.JOBS, cores=2)
    order = [job.name for _, job in starts]
    assert order == simulate(schedule.JOBS, cores=2)[0]  # what run() starts, in the same order
    single = sum(j.estimate_s for j in schedule.JOBS if j.threads == 1)
    assert single / 2 + schedule.JOBS[1].estimate_s <= wall <= single / 2 + schedule.JOBS[1].estimate_s + 7_000
    starts16, wall16 = schedule.plan(schedule.JOBS, cores=16)
    assert {start for start, _ in starts16} == {0.0} and wall16 == max(j.estimate_s for j in schedule.JOBS)


def test_dry_run_prints_the_plan(capsys):
    assert schedule.main(["--dry-run", "--cores", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(schedule.JOBS) + 1 and out[0].startswith("at  0.0 h: study4_gemma3 (1 thread(s)")
    assert "kvcert.studies.walltime study2 -- " in out[-2] and out[-1].startswith("about ")
