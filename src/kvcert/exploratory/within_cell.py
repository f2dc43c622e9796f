"""Exploratory (not pre-registered): C6's AUROCs counted only within task x context-length cells.

C6 asks whether, among failures, the certificate separates cache-induced failures (the full cache was right) from
inherent ones better than confidence. Pooled over cells, a confound can carry that: cache-induced failures pile up
at short contexts and the certificate falls with length, so length alone separates the two kinds. Counting only
pairs (one cache-induced, one inherent failure) inside the same task x nominal-length cell removes what separates
cells and keeps what separates answers. Same rows as each study's C6 (randomized window_question, tail 0.75,
floor 0.2, budget 0.25), the published records, 95% example-cluster bootstrap intervals (2000 resamples, seed 0).

    python -m kvcert.exploratory.within_cell   # -> results/exploratory/within_cell_c6.{md,csv}
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.tables import markdown_table
from kvcert.studies.study4.analysis import pooled_auroc, within_cell_auroc

ROOT = Path(__file__).resolve().parents[3]
STUDIES = {
    "study2": ROOT / "results" / "study2" / "published" / "examples.parquet",
    "study3_smollm2": ROOT / "results" / "study3" / "smollm2" / "published" / "examples.parquet",
    "study3_gemma3": ROOT / "results" / "study3" / "gemma3" / "published" / "examples.parquet",
}
LENGTHS = np.array([1000, 2000, 4000])


def c6_rows(examples: pd.DataFrame) -> pd.DataFrame:
    ex = examples[
        (examples["scorer"] == "window_question")
        & (examples["design"] == "randomized")
        & (examples["budget"] == 0.25)
        & (examples["tail_fraction"] == 0.75)
        & (examples["floor"] == 0.2)
        & ~examples["correct"].astype(bool)
    ]
    ex = ex[np.isfinite(ex["cert_score"]) & np.isfinite(ex["logprob_mean"])].copy()
    ex["cell"] = ex["task"].astype(str) + "@" + pd.Series(_nominal(ex["context_tokens"]), index=ex.index).astype(str)
    return ex


def _nominal(tokens: pd.Series) -> np.ndarray:
    return LENGTHS[np.abs(tokens.to_numpy()[:, None] - LENGTHS[None, :]).argmin(1)]


def analyse(ex: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> dict:
    labels = ex["full_correct"].to_numpy(bool)
    cert, conf = ex["cert_score"].to_numpy(np.float64), -ex["logprob_mean"].to_numpy(np.float64)
    cells = ex["cell"].to_numpy()
    length = ex["context_tokens"].to_numpy(np.float64)
    out = {
        "n_failures": len(ex),
        "n_cache_induced": int(labels.sum()),
        "pooled_cert": pooled_auroc(labels, cert),
        "pooled_confidence": pooled_auroc(labels, conf),
        "pooled_shorter_context": pooled_auroc(labels, -length),
        "within_cert": within_cell_auroc(labels, cert, cells),
        "within_confidence": within_cell_auroc(labels, conf, cells),
    }
    ids, codes = np.unique(ex["example_id"].to_numpy(), return_inverse=True)
    rng = np.random.default_rng(seed)
    boot = {"within_cert": [], "within_confidence": []}
    for _ in range(n_boot):
        take = np.concatenate([np.flatnonzero(codes == c) for c in rng.integers(0, len(ids), len(ids))])
        boot["within_cert"].append(within_cell_auroc(labels[take], cert[take], cells[take]))
        boot["within_confidence"].append(within_cell_auroc(labels[take], conf[take], cells[take]))
    for key, values in boot.items():
        lo, hi = np.nanpercentile(values, [2.5, 97.5])
        out[f"{key}_ci"] = f"[{lo:.2f}, {hi:.2f}]"
    return out


def main() -> None:
    rows = []
    for study, path in STUDIES.items():
        rows.append({"study": study, **analyse(c6_rows(pd.read_parquet(path)))})
    table = pd.DataFrame(rows)
    out = ROOT / "results" / "exploratory"
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "within_cell_c6.csv", index=False, float_format="%.4f")
    text = (
        "# C6 within task x length cells (exploratory, not pre-registered)\n\n"
        "AUROC for cache-induced among failed rows of C6 (randomized window_question, budget 0.25): pooled over\n"
        "every pair, and counting only pairs inside one task x nominal-length cell (95% example-cluster bootstrap).\n"
        "`pooled_shorter_context` ranks by context length alone (shorter = cache-induced).\n\n"
        + markdown_table(table, floatfmt=".3f")
        + "\n"
    )
    (out / "within_cell_c6.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
