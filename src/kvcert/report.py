"""`kvcert report <runs or multirun folder>`: a sweep of your own as a table, a figure and a page, from the records
alone (pure pandas over each cell's `examples.parquet`; docs/records.md).

    kvcert report multirun/2026-12-07/10-00-00     # a Hydra multirun (what kvcert-run -m writes at its end)
    kvcert report results/runs                     # every cell folder under it
    kvcert report results/runs/<cell> --out my_report

For each policy (scorer x design and its parameters; the budget left out) and budget: accuracy with a 95%
example-cluster bootstrap interval, the full cache's accuracy on the same examples beside it, the certificate's
coverage (the share of (step, layer, head) cells whose error is within the 95% radius; designs with a certificate,
oracle on), and the KV held (kept prompt tokens over prompt tokens, of the compressed layers). Written as
report.md, report.png and a self-contained report.html (the figure inlined) into the folder (or --out).
"""

from __future__ import annotations

import argparse
import base64
import html
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

N_BOOT = 1000
LEVEL = 0.95
HEADER = ["policy", "budget", "examples", "accuracy [95% CI]", "full cache [95% CI]", "coverage of the 95% radius",
          "KV held"]  # fmt: skip


class ReportError(ValueError):
    """No records where the report was asked for: one line naming the folder and what was looked for."""


# -------------------------------------------------------------------------------------------------- the records
def cell_folders(folder: str | Path) -> list[Path]:
    """The cell folders a report covers: the folder itself when it holds examples.parquet; a Hydra multirun (or run)
    folder's jobs, through the `records` file each job writes (the cell folder's path); else every folder below it
    that holds examples.parquet."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ReportError(f"{folder} is not a folder: pass a cell folder, a runs folder or a multirun folder")
    if (root / "examples.parquet").is_file():
        return [root]
    cells: list[Path] = []
    for pointer in sorted(root.glob("*/records")) + sorted(root.glob("records")):
        cell = Path(pointer.read_text().strip())
        if (cell / "examples.parquet").is_file() and cell not in cells:
            cells.append(cell)
    if not cells:
        cells = sorted({p.parent for p in root.rglob("examples.parquet") if p.parent.name != "shards"})
    if not cells:
        raise ReportError(
            f"no records under {folder}: no examples.parquet (a complete kvcert-run cell) and no job `records` file"
        )
    return cells


def load_records(folder: str | Path) -> pd.DataFrame:
    """Every covered cell's examples.parquet, one frame."""
    frames = [pd.read_parquet(cell / "examples.parquet") for cell in cell_folders(folder)]
    return pd.concat(frames, ignore_index=True)


def policy_name(row: pd.Series) -> str:
    """A policy without its budget: "window_question/randomized t0.5 f0.2" (the variant label, budget removed)."""
    if row["design"] == "full":
        return "full cache"
    parts = [p for p in str(row["variant"]).split("/") if not re.fullmatch(r"b[0-9.e+-]+", p)]
    head, rest = "/".join(parts[:2]), [p for p in parts[2:] if not re.fullmatch(r"s\d+", p)]
    return " ".join([head, *rest])


# ------------------------------------------------------------------------------------------------- the numbers
def _bootstrap(values: pd.Series, clusters: pd.Series, rng: np.random.Generator) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of a 0/1 column and its example-cluster bootstrap interval."""
    frame = pd.DataFrame({"v": values.astype(float).to_numpy(), "c": clusters.to_numpy()})
    sums = frame.groupby("c")["v"].agg(["sum", "count"])
    if len(sums) == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(sums["sum"].sum() / sums["count"].sum())
    if len(sums) < 2:
        return mean, float("nan"), float("nan")
    idx = rng.integers(0, len(sums), size=(N_BOOT, len(sums)))
    s, n = sums["sum"].to_numpy()[idx].sum(axis=1), sums["count"].to_numpy()[idx].sum(axis=1)
    lo, hi = np.quantile(s / n, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return mean, float(lo), float(hi)


def report_table(examples: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """One row per (policy, budget), the full cache first: examples, accuracy and its interval, the full cache's
    accuracy on the same examples and its interval, the certificate's coverage and the KV held."""
    df = examples[~examples["nonfinite"].astype(bool)] if "nonfinite" in examples else examples
    # an example is one cluster across cells (a budget sweep reads the same examples in every cell)
    df = df.assign(policy=df.apply(policy_name, axis=1), cluster=df["example_id"].astype(str))
    full = df[df["design"] == "full"].groupby("cluster")["correct"].mean()
    rng = np.random.default_rng(seed)
    rows = []
    for (policy, budget), g in df.groupby(["policy", "budget"], sort=True):
        acc, lo, hi = _bootstrap(g["correct"], g["cluster"], rng)
        same = full.reindex(g["cluster"].unique()).dropna()
        f_acc, f_lo, f_hi = _bootstrap(same, pd.Series(same.index), rng) if len(same) else (np.nan,) * 3
        cert = g[g["has_certificate"].astype(bool) & (g["steps_total"] > 0)]
        coverage = cert["steps95"].sum() / cert["steps_total"].sum() if len(cert) else np.nan
        held = (g["kept_tokens"] / g["context_tokens"]).mean() if policy != "full cache" else 1.0
        rows.append(
            dict(
                policy=policy,
                budget=float(budget),
                examples=int(g["cluster"].nunique()),
                accuracy=acc,
                accuracy_lo=lo,
                accuracy_hi=hi,
                full_accuracy=f_acc,
                full_lo=f_lo,
                full_hi=f_hi,
                coverage=coverage,
                kv_held=float(held),
            )  # fmt: skip
        )
    table = pd.DataFrame(rows)
    order = table["policy"].ne("full cache")  # the full cache first, then the policies by name and budget
    return table.assign(_o=order).sort_values(["_o", "policy", "budget"]).drop(columns="_o").reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------- rendering
def _pct(x: float) -> str:
    return "n/a" if not np.isfinite(x) else f"{100 * x:.1f}%"


def _interval(x: float, lo: float, hi: float) -> str:
    return _pct(x) + ("" if not np.isfinite(lo) else f" [{100 * lo:.1f}, {100 * hi:.1f}]")


def _cells(table: pd.DataFrame) -> list[list[str]]:
    return [
        [
            r.policy,
            f"{r.budget:g}",
            str(r.examples),
            _interval(r.accuracy, r.accuracy_lo, r.accuracy_hi),
            _interval(r.full_accuracy, r.full_lo, r.full_hi),
            _pct(r.coverage),
            _pct(r.kv_held),
        ]  # fmt: skip
        for r in table.itertuples()
    ]


def _notes(examples: pd.DataFrame, cells: list[Path]) -> list[str]:
    full = examples[examples["design"] == "full"]
    out = [
        f"{len(cells)} cell folder(s), {examples['example_id'].nunique()} examples, tasks: "
        + ", ".join(sorted(map(str, examples["task"].unique()))),
        "accuracy: the share of examples answered correctly by the task's metric; [95% CI]: example-cluster bootstrap "
        f"({N_BOOT} draws); full cache: the same examples with the full cache",
        "coverage: the share of (answer step, layer, head) cells whose true error is within the certificate's 95% "
        "radius (designs with a certificate, oracle on; n/a otherwise); KV held: kept prompt tokens / prompt tokens "
        "(compressed layers)",
        "policy: scorer/design, then t = tail fraction (share of the budget drawn at random), f = floor, p = score "
        "power",
    ]
    if len(full) and not full["correct"].any():
        out.append("warning: the full cache answered none correctly: check the answers against the task's metric")
    return out


def plot_report(table: pd.DataFrame, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cx) = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = table[table["policy"] != "full cache"]
    colours = plt.get_cmap("tab10" if policies["policy"].nunique() <= 10 else "tab20")
    for i, (policy, g) in enumerate(policies.groupby("policy", sort=True)):
        g, colour = g.sort_values("budget"), colours(i % colours.N)
        err = np.vstack([g["accuracy"] - g["accuracy_lo"], g["accuracy_hi"] - g["accuracy"]]).clip(min=0)
        ax.errorbar(g["budget"], 100 * g["accuracy"], yerr=100 * np.nan_to_num(err), marker="o", capsize=3,
                    label=policy, color=colour)  # fmt: skip
        if g["coverage"].notna().any():
            cx.plot(g["budget"], 100 * g["coverage"], marker="o", label=policy, color=colour)
    full = table[table["policy"] == "full cache"]
    if len(full):
        f = full.iloc[0]
        ax.axhline(100 * f["accuracy"], color="k", ls="--", lw=1, label="full cache")
        if np.isfinite(f["accuracy_lo"]):
            ax.axhspan(100 * f["accuracy_lo"], 100 * f["accuracy_hi"], color="k", alpha=0.08)
    ax.set(xlabel="budget (kept share of the prompt)", ylabel="accuracy (%)", title="accuracy against budget")
    ax.set_ylim(-2, 102)
    ax.legend(fontsize=7, loc="best")
    cx.axhline(95, color="k", ls=":", lw=1, label="nominal 95%")
    cx.set(xlabel="budget", ylabel="coverage (%)", title="certificate coverage of its 95% radius")
    cx.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_markdown(table: pd.DataFrame, notes: list[str], title: str) -> str:
    from kvcert.analysis.tables import markdown_table

    body = pd.DataFrame([[c.replace("|", "\\|") for c in r] for r in _cells(table)], columns=HEADER)
    warn = [f"**{n}**" for n in notes if n.startswith("warning:")]  # above the table, where it is read
    lines = [f"# {title}", "", *(warn and [*warn, ""]), markdown_table(body, parse_numbers=False), "",
             "![report](report.png)", ""]  # fmt: skip
    return "\n".join(lines + [f"- {n}" for n in notes if not n.startswith("warning:")]) + "\n"


def report_html(table: pd.DataFrame, notes: list[str], title: str, png: Path) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in _cells(table))
    image = base64.b64encode(png.read_bytes()).decode()
    style = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse}"
             "td,th{border:1px solid #999;padding:4px 8px}td:nth-child(n+2){text-align:right}")  # fmt: skip
    items = "".join(f"<li>{html.escape(n)}</li>" for n in notes if not n.startswith("warning:"))
    warn = "".join(f"<p><b>{html.escape(n)}</b></p>" for n in notes if n.startswith("warning:"))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style>"
        f"</head><body><h1>{html.escape(title)}</h1>{warn}<table><tr>{head}</tr>{rows}</table>"
        f"<p><img alt='accuracy and coverage against budget' style='max-width:100%' "
        f"src='data:image/png;base64,{image}'></p><ul>{items}</ul></body></html>\n"
    )


def write_report(folder: str | Path, out: str | Path | None = None) -> dict[str, Path]:
    """report.md, report.png and report.html for the records under `folder`, into `out` (default: the folder)."""
    cells = cell_folders(folder)
    examples = pd.concat([pd.read_parquet(c / "examples.parquet") for c in cells], ignore_index=True)
    table = report_table(examples)
    out_dir = Path(out) if out is not None else Path(folder)
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"kvcert report: {Path(folder).name}"
    notes = _notes(examples, cells)
    paths = {"png": plot_report(table, out_dir / "report.png"), "md": out_dir / "report.md",
             "html": out_dir / "report.html"}  # fmt: skip
    paths["md"].write_text(report_markdown(table, notes, title))
    paths["html"].write_text(report_html(table, notes, title, paths["png"]))
    return paths


# ------------------------------------------------------------------------------------------- command and hook
def add_parser(sub) -> None:
    r = sub.add_parser("report", help="a table, a figure and a page of your own runs' records")
    r.add_argument("folder", help="a kvcert-run cell folder, a folder of them (results/runs) or a multirun folder")
    r.add_argument("--out", default=None, help="where report.{md,png,html} go (default: the folder)")


def cmd_report(args: argparse.Namespace) -> int:
    try:
        paths = write_report(args.folder, args.out)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[kvcert] report: {paths['md']} {paths['png']} {paths['html']}")
    return 0


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency
    Callback = object  # type: ignore[misc, assignment]


class ReportCallback(Callback):
    """Hydra callback (conf/config.yaml, hydra.callbacks.report): `kvcert report` on the multirun folder when a
    multirun ends; a failure is one warning line, never the multirun's."""

    def on_multirun_end(self, config, **kwargs) -> None:
        folder = Path(str(config.hydra.sweep.dir))
        try:
            paths = write_report(folder)
        except Exception as err:  # the records are written; a report that fails must not fail the sweep
            print(f"[kvcert] warning: no report for {folder}: {err}", file=sys.stderr, flush=True)
            return
        print(f"[kvcert] report of the multirun: {paths['md']} (also {paths['png'].name}, {paths['html'].name})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return cmd_report(parser.parse_args(["report", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())
