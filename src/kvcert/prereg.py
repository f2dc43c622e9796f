"""Pre-registration lock: hash the predictions, the plan, the claim configs and the analysis code; detect changes.

    python -m kvcert.prereg lock [--force] [--root DIR]
    python -m kvcert.prereg verify [--allow-deviations] [--root DIR]

Bytes are hashed as they are (no normalization), so any edit, including whitespace, is a deviation. A deviation
is recorded by naming the file in the log section of preregistration/DEVIATIONS.md; verify reports whether every
changed, missing or added file is named there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

LOCK_PATH = "preregistration/LOCK.json"
DEVIATIONS_PATH = "preregistration/DEVIATIONS.md"
LOCKED_FILES = ("preregistration/predictions.yaml", "preregistration/PREREGISTRATION.md")
LOCKED_GLOBS = ("conf/claim/*.yaml", "src/kvcert/analysis/*.py")
LOG_HEADING = "## Log"  # only file names below this heading count as recorded (the template above it has examples)


def locked_files(root: str | Path) -> list[str]:
    """Relative paths (posix, sorted) of the files the lock covers that exist under root."""
    root = Path(root)
    paths = {p for p in LOCKED_FILES if (root / p).is_file()}
    for pattern in LOCKED_GLOBS:
        paths |= {p.relative_to(root).as_posix() for p in root.glob(pattern) if p.is_file()}
    return sorted(paths)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git_commit(root: str | Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def lock(root: str | Path, force: bool = False) -> dict:
    """Write preregistration/LOCK.json; refuses to overwrite an existing lock unless force (re-locking after
    results exist would hide a deviation)."""
    root = Path(root)
    target = root / LOCK_PATH
    if target.exists() and not force:
        raise FileExistsError(f"{LOCK_PATH} exists; re-locking replaces the pre-registration (use --force)")
    missing = [p for p in LOCKED_FILES if not (root / p).is_file()]
    if missing:
        raise FileNotFoundError(f"cannot lock, missing: {', '.join(missing)}")
    record = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(root),
        "files": {p: sha256_file(root / p) for p in locked_files(root)},
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=2) + "\n")
    return record


def recorded_in_deviations(root: str | Path, files: list[str]) -> dict[str, bool]:
    """Whether each file is named in the log section of DEVIATIONS.md."""
    path = Path(root) / DEVIATIONS_PATH
    text = path.read_text() if path.is_file() else ""
    if LOG_HEADING in text:
        text = text.split(LOG_HEADING, 1)[1]
    return {f: f in text for f in files}


def verify(root: str | Path) -> dict:
    """Compare the lock with the tree: status verified | deviates | unlocked, and the files involved."""
    root = Path(root)
    target = root / LOCK_PATH
    if not target.is_file():
        return {
            "status": "unlocked",
            "changed": [],
            "missing": [],
            "added": [],
            "deviations_recorded": False,
            "unrecorded": [],
        }
    locked = json.loads(target.read_text())["files"]
    present = set(locked_files(root))
    missing = sorted(p for p in locked if not (root / p).is_file())
    changed = sorted(p for p in locked if p not in missing and sha256_file(root / p) != locked[p])
    added = sorted(present - set(locked))
    involved = changed + missing + added
    recorded = recorded_in_deviations(root, involved)
    return {
        "status": "deviates" if involved else "verified",
        "changed": changed,
        "missing": missing,
        "added": added,
        "deviations_recorded": all(recorded.values()),
        "unrecorded": [f for f, ok in recorded.items() if not ok],
        "lock": {k: v for k, v in json.loads(target.read_text()).items() if k != "files"},
    }


def _find_root(start: Path) -> Path:
    for p in (start, *start.parents):
        if (p / "pyproject.toml").is_file() or (p / "preregistration").is_dir():
            return p
    return start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.prereg", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["lock", "verify"])
    parser.add_argument("--root", type=Path, default=None, help="repository root (default: found from cwd)")
    parser.add_argument("--force", action="store_true", help="lock: overwrite an existing LOCK.json")
    parser.add_argument(
        "--allow-deviations",
        action="store_true",
        help="verify: accept deviations recorded in DEVIATIONS.md (the default; kept for old commands)",
    )
    parser.add_argument("--strict", action="store_true", help="verify: fail on any deviation, recorded or not")
    args = parser.parse_args(argv)
    root = args.root or _find_root(Path.cwd())

    if args.command == "lock":
        try:
            record = lock(root, force=args.force)
        except (FileExistsError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"locked {len(record['files'])} files into {LOCK_PATH} (commit {record['git_commit']})")
        return 0

    res = verify(root)
    if res["status"] == "verified":
        print(f"pre-registration verified: {LOCK_PATH} matches the tree")
        return 0
    if res["status"] == "unlocked":
        msg = f"pre-registration is not locked: {LOCK_PATH} not found (run `make lock` after the pilot)"
    else:
        parts = [f"{k}: {', '.join(res[k])}" for k in ("changed", "missing", "added") if res[k]]
        note = (
            "all recorded in DEVIATIONS.md"
            if res["deviations_recorded"]
            else f"not recorded in DEVIATIONS.md: {', '.join(res['unrecorded'])}"
        )
        msg = f"pre-registration deviates: {'; '.join(parts)} ({note})"
    # a deviation recorded in DEVIATIONS.md is allowed (the scorecard marks the run); an unrecorded one never is
    if res["status"] == "deviates" and res["deviations_recorded"] and not args.strict:
        print(f"warning: {msg}; continuing, the scorecard marks this run", file=sys.stderr)
        return 0
    fix = " (record it in preregistration/DEVIATIONS.md before running)" if res["status"] == "deviates" else ""
    print(f"error: {msg}{fix}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
