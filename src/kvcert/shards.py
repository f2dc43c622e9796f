"""The resumable shard store of one cell: one Parquet shard per example, written atomically, merged at the end.

A shard is written steps first, examples last, each to a temp file that is flushed and fsync'ed, renamed into place,
and the folder fsync'ed, so the presence of the examples file means the shard is complete, also after a power loss.
A rerun skips complete shards; a killed run leaves at most a temp file, which the next run removes. Merging is also
temp + rename, so a finished examples.parquet is never half written. A rerun checks every shard's Parquet footer
first: an unreadable shard (a file truncated by hand, or one written by a version without the fsync and cut short by
a power loss) is moved, with its sibling of the same index, to shards/corrupt/<timestamp>/ (never deleted), named in a
one-line warning, and its example is redone.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def fsync_dir(folder: Path) -> None:
    """fsync a folder, so a rename inside it survives a power loss; best effort where folders cannot be opened or
    synced (Windows, some network file systems)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> None:
    """write(file) into <path>.tmp, flush and fsync it, rename it onto path, fsync the folder: after a crash or a
    power loss path holds either its old content or all of the new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_parquet(df: pd.DataFrame, path: Path) -> None:
    _atomic_write(path, lambda f: df.to_parquet(f, index=False))


def atomic_text(text: str, path: Path) -> None:
    _atomic_write(path, lambda f: f.write(text.encode()))


def unreadable_parquet(path: Path) -> str | None:
    """Why a Parquet file cannot be read (its footer and schema), in one line; None when it can. A permission
    problem is raised, not reported: the file is not damaged."""
    try:
        pq.read_schema(path)
    except PermissionError:
        raise
    except (OSError, ValueError, pa.ArrowException) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return reason[:200]
    return None


def _move_aside(files: list[Path], folder: Path) -> Path:
    """Move files into folder (created), never overwriting; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        dest, n = folder / f.name, 1
        while dest.exists():
            dest, n = folder / f"{f.name}.{n}", n + 1
        os.replace(f, dest)
    fsync_dir(folder)
    for parent in {f.parent for f in files}:
        fsync_dir(parent)
    return folder


class ShardError(Exception):
    """A shard whose footer was readable failed to read when merged: it has been moved aside; the message is one
    line naming it (a rerun redoes its example)."""


class ShardStore:
    """The shards of one cell under <run_dir>/shards/."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.shards = self.run_dir / "shards"

    def open(self) -> ShardStore:
        """Create the folders and drop temp files a killed run left behind."""
        self.shards.mkdir(parents=True, exist_ok=True)
        for tmp in self.run_dir.rglob("*.tmp"):
            tmp.unlink()
        return self

    def _stem(self, index: int) -> str:
        return f"{index:06d}"

    def is_done(self, index: int) -> bool:
        return (self.shards / f"{self._stem(index)}.examples.parquet").exists()

    def _corrupt_dir(self, base: Path) -> Path:
        return base / "corrupt" / datetime.now().strftime("%Y%m%dT%H%M%S")

    def check(self, expect_steps: bool = False) -> list[str]:
        """Validate every complete shard (examples file present): both its files must have a readable Parquet
        footer, and with expect_steps its steps file must exist. A failing shard's files are moved to
        shards/corrupt/<timestamp>/ (never deleted), so the shard counts as not done and is written again; returns
        one warning line per moved shard, naming the file, the reason and where it went."""
        warnings = []
        for examples in sorted(self.shards.glob("*.examples.parquet")):
            stem = examples.name.split(".", 1)[0]
            steps = self.shards / f"{stem}.steps.parquet"
            bad = {f: why for f in (examples, steps) if f.exists() and (why := unreadable_parquet(f))}
            if not bad and expect_steps and not steps.exists():
                bad = {examples: f"its steps shard {steps.name} is missing"}
            if bad:
                warnings.append("warning: " + self._quarantine(stem, bad) + "; its example is redone")
        return warnings

    def _quarantine(self, stem: str, bad: dict[Path, str]) -> str:
        """Move every file of shard `stem` to shards/corrupt/<timestamp>/; the one-line account of it."""
        examples = self.shards / f"{stem}.examples.parquet"
        # siblings first, the examples file last: a crash in between leaves the shard not done, or checked again
        files = [f for f in sorted(self.shards.glob(f"{stem}.*")) if f != examples and f.is_file()]
        files += [examples] if examples.exists() else []
        folder = _move_aside(files, self._corrupt_dir(self.shards))
        what = "; ".join(f"shard {f} is unreadable ({why})" for f, why in bad.items())
        return f"{what}: moved {', '.join(f.name for f in files)} to {folder}/"

    def _read(self, path: Path) -> pd.DataFrame:
        try:
            return pd.read_parquet(path)
        except PermissionError:
            raise
        except (OSError, ValueError, pa.ArrowException) as err:
            reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            moved = self._quarantine(path.name.split(".", 1)[0], {path: reason})
            raise ShardError(f"{moved}; rerun to redo its example") from None

    def check_merged(self) -> list[str]:
        """For a complete folder: the merged examples.parquet / steps.parquet must be readable. If one is not, it is
        moved with COMPLETE to <run_dir>/corrupt/<timestamp>/ (never deleted), so the folder is merged again from its
        shards; returns the warning lines."""
        if not (self.run_dir / "COMPLETE").exists():
            return []
        merged = [self.run_dir / n for n in ("examples.parquet", "steps.parquet")]
        bad = {f: why for f in merged if f.exists() and (why := unreadable_parquet(f))}
        if not bad:
            return []
        files = [*bad, self.run_dir / "COMPLETE"]
        folder = _move_aside(files, self._corrupt_dir(self.run_dir))
        what = "; ".join(f"{f} is unreadable ({why})" for f, why in bad.items())
        moved = ", ".join(f.name for f in files)
        return [f"warning: {what}: moved {moved} to {folder}/; the shards are checked and merged again"]

    def write(self, index: int, examples: pd.DataFrame, steps: pd.DataFrame | None) -> None:
        stem = self._stem(index)
        if steps is not None:
            atomic_parquet(steps, self.shards / f"{stem}.steps.parquet")
        atomic_parquet(examples, self.shards / f"{stem}.examples.parquet")  # last: marks the shard complete

    def merge(self, expected: int) -> tuple[pd.DataFrame, int]:
        """Concatenate complete shards into examples.parquet / steps.parquet; returns (examples, n_shards)."""
        ex_files = sorted(self.shards.glob("*.examples.parquet"))
        examples = pd.concat([self._read(f) for f in ex_files], ignore_index=True)
        atomic_parquet(examples, self.run_dir / "examples.parquet")
        step_files = [
            f
            for f in sorted(self.shards.glob("*.steps.parquet"))
            if (self.shards / f.name.replace(".steps.", ".examples.")).exists()
        ]
        if step_files:
            steps = pd.concat([self._read(f) for f in step_files], ignore_index=True)
            atomic_parquet(steps, self.run_dir / "steps.parquet")
        if len(ex_files) == expected:
            atomic_text(json.dumps({"shards": expected}), self.run_dir / "COMPLETE")
        return examples, len(ex_files)

    @property
    def complete(self) -> bool:
        return (self.run_dir / "COMPLETE").exists() and (self.run_dir / "examples.parquet").exists()
