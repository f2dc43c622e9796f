"""Each `make reproduce` step's wall time, in results/provenance.json:

    python -m kvcert.studies.walltime study4 -- python -m kvcert.studies.study4 run --model smollm2 --regenerate

runs the command unchanged (its output and exit code pass through) and keeps one entry under
"reproduce_wall_seconds" -> <study>: the command, its wall seconds, exit code, finish time, commit and CPU. The entry
is written when the step starts and rewritten every HEARTBEAT_S seconds while it runs (exit code null), then with
its exit code when it ends, so a step killed by a signal it cannot catch (SIGKILL, as at a session's end) keeps the
seconds up to its last rewrite. A resumed step adds another entry, so a study's wall time is the sum of its entries
(`totals`). A step stopped by Ctrl-C or SIGTERM is recorded with its exit code (130, 143) after the command has
stopped. The commit is the one checked out when the step started. The file's other keys are kept.

    python -m kvcert.studies.walltime totals [--since 2026-12-06T19:34]

prints, over the steps that started at or after --since (UTC; default: every step), each study's summed seconds and
the run's elapsed wall time: the union of the steps' intervals, so steps side by side count once and the time between
a killed run and its resumption not at all. `make reproduce` prints it for its own invocation; a run resumed across
invocations gives its first start as --since.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

PROVENANCE = Path("results/provenance.json")
KEY = "reproduce_wall_seconds"
HEARTBEAT_S = 60.0


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def record(
    study: str,
    command: list[str],
    seconds: float,
    code: int | None,
    path: Path | None = None,
    commit: str | None = None,
    step_id: str | None = None,
) -> dict:
    """Write one step's entry to `path` (default PROVENANCE) through a temporary file, so a kill never leaves half a
    file: appended, or replacing the entry of the same `step_id` (a running step's rewrite); code None: still
    running; commit: the code the step ran (default: HEAD now)."""
    import fcntl

    from kvcert.records import cpu_model

    path = path or PROVENANCE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".json.lock"), "w") as lock:  # make reproduce's jobs finish side by side
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _write(study, command, seconds, code, path, cpu_model(), commit or _commit(), step_id)


def _write(study: str, command: list[str], seconds: float, code, path: Path, cpu: str, commit, step_id) -> dict:
    data = json.loads(path.read_text()) if path.is_file() else {}
    entry = dict(command=" ".join(command), seconds=round(seconds, 1), exit_code=code, commit=commit,
                 finished=datetime.now(timezone.utc).isoformat(timespec="seconds"), cpu=cpu,
                 cores=os.cpu_count())  # fmt: skip
    if step_id is not None:
        entry["step"] = step_id
    entries = data.setdefault(KEY, {}).setdefault(study, [])
    same = [i for i, e in enumerate(entries) if step_id is not None and e.get("step") == step_id]
    if same:
        entries[same[0]] = entry
    else:
        entries.append(entry)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return entry


def _utc(stamp: str) -> datetime:
    """An ISO time; one without a zone is UTC."""
    t = datetime.fromisoformat(stamp)
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _intervals(path: Path | None, since: str | None) -> dict[str, list[tuple[float, float]]]:
    """{study: [(start, end) in POSIX seconds]} of the steps that started at or after `since` (None: every step)."""
    path = path or PROVENANCE
    data = json.loads(path.read_text()) if path.is_file() else {}
    start = _utc(since).timestamp() if since else float("-inf")
    out: dict[str, list[tuple[float, float]]] = {}
    for study, entries in data.get(KEY, {}).items():
        spans = [(_utc(e["finished"]).timestamp() - e["seconds"], _utc(e["finished"]).timestamp()) for e in entries]
        if kept := [(a, b) for a, b in spans if a >= start]:
            out[study] = kept
    return out


def totals(path: Path | None = None, since: str | None = None) -> dict[str, float]:
    """{study: wall seconds summed over its steps started at or after `since`} (steps side by side overlap)."""
    return {study: round(sum(b - a for a, b in spans), 1) for study, spans in _intervals(path, since).items()}


def elapsed(path: Path | None = None, since: str | None = None) -> float:
    """Wall seconds during which at least one step that started at or after `since` ran: the union of the steps'
    intervals (side by side once; the gap between a killed run and its resumption not at all)."""
    spans = sorted(span for spans in _intervals(path, since).values() for span in spans)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return round(total, 1)


def _print_totals(args: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcert.studies.walltime totals")
    ap.add_argument("--since", default=None, help="count the steps that started at or after this ISO time (UTC)")
    opts = ap.parse_args(args)
    try:
        sums, wall = totals(since=opts.since), elapsed(since=opts.since)
    except ValueError as err:  # a --since that is no ISO time
        print(f"error: --since {opts.since!r}: {err}; give an ISO time such as 2026-12-06T19:34", file=sys.stderr)
        return 2
    since = f" since {opts.since}" if opts.since else ""
    print(f"wall seconds per study{since} (summed over its steps): {sums}")
    print(f"elapsed{since}: {wall:,.0f} s ({wall / 3600:.2f} h; steps side by side counted once)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["totals"]:
        return _print_totals(args[1:])
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m kvcert.studies.walltime <study> -- <command ...> | totals [--since ISO]",
              file=sys.stderr)  # fmt: skip
        return 2
    study, command = args[0], args[2:]
    commit = _commit()  # the code the step starts with (a checkout may move on while it runs)
    step_id = f"{os.getpid()}-{time.time_ns()}"  # this run of the step: its entry is rewritten, not another's
    started = time.perf_counter()
    child = subprocess.Popen(command)

    stopped: list[int] = []

    def stop(signum, _frame):  # SIGTERM (a scheduler, a session's end): stop the step; the wait below returns
        stopped.append(signum)
        child.terminate()

    signal.signal(signal.SIGTERM, stop)
    try:
        record(study, command, 0.0, None, commit=commit, step_id=step_id)  # the step is on record while it runs
        while True:
            try:
                code = child.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:  # still running: rewrite the entry with the seconds so far
                record(study, command, time.perf_counter() - started, None, commit=commit, step_id=step_id)
    except KeyboardInterrupt:
        child.wait()
        record(study, command, time.perf_counter() - started, 130, commit=commit, step_id=step_id)
        raise
    code = 128 + stopped[0] if stopped else code
    record(study, command, time.perf_counter() - started, code, commit=commit, step_id=step_id)
    return code


if __name__ == "__main__":
    sys.exit(main())
