"""Each `make reproduce` step's wall time, in results/provenance.json:

    python -m kvcert.studies.walltime study4 -- python -m kvcert.studies.study4 run --model smollm2 --regenerate

runs the command unchanged (its output and exit code pass through) and keeps one entry under
"reproduce_wall_seconds" -> <study>: the command, its wall seconds, exit code, finish time, commit and CPU. The entry
is written when the step starts and rewritten every HEARTBEAT_S seconds while it runs (exit code null), then with
its exit code when it ends, so a step killed by a signal it cannot catch (SIGKILL, as at a session's end) keeps the
seconds up to its last rewrite. A resumed step adds another entry, so a study's wall time is the sum of its entries
(`totals`). A step stopped by Ctrl-C or SIGTERM is recorded with its exit code (130, 143) after the command has
stopped. The commit is the one checked out when the step started. The file's other keys are kept.
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


def totals(path: Path | None = None) -> dict[str, float]:
    """{study: wall seconds summed over its recorded steps} (steps of studies run side by side overlap)."""
    path = path or PROVENANCE
    data = json.loads(path.read_text()) if path.is_file() else {}
    return {study: round(sum(e["seconds"] for e in entries), 1) for study, entries in data.get(KEY, {}).items()}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m kvcert.studies.walltime <study> -- <command ...>", file=sys.stderr)
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
