"""The benchmark's figures: cost scaling with context length and variants, and the roofline (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(rows: list[dict], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    variants = sorted({r["variants"] for r in rows})
    lengths = sorted({r["tokens"] for r in rows})
    ax = axes[0]
    for v in variants:
        pts = sorted((r["tokens"], r["shared_s"], r["reprefill_s"]) for r in rows if r["variants"] == v)
        xs = [p[0] for p in pts]
        (line,) = ax.plot(xs, [p[1] for p in pts], "o-", label=f"shared, {v} variants")
        if v > 1:
            ax.plot(xs, [p[2] for p in pts], "s--", color=line.get_color(), label=f"re-prefill, {v} variants")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context tokens",
        ylabel="seconds per example (prefill + decode)",
        title="total cost vs context length",
    )
    ax.legend(fontsize=7)
    ax = axes[1]
    for n in lengths:
        pts = sorted((r["variants"], r["shared_s"], r["reprefill_s"]) for r in rows if r["tokens"] == n)
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"shared, {n} tokens")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", color=line.get_color(), label=f"re-prefill, {n}")
    ax.set(xscale="log", yscale="log", xlabel="variants", ylabel="seconds per example", title="total cost vs variants")
    ax.legend(fontsize=7)
    ax = axes[2]
    for n in lengths:
        pts = sorted((r["variants"], r["decode_step_s"]) for r in rows if r["tokens"] == n)
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], "o-", label=f"{n} tokens")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="variants",
        ylabel="ms per decode step (all variants)",
        title="decode step (certificate + oracle)",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_roofline(roof: dict, path: Path) -> None:
    """Left: achieved flop rate vs arithmetic intensity under the measured roof (bandwidth slope, matmul ceilings
    per M). Right: measured step / limit vs variants, per context length and configuration."""
    plt = _plt()
    rows = roof["rows"]
    bw = roof["machine"]["bandwidth"]["bandwidth_Bps"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    xs = [r["intensity"] for r in rows]
    lo, hi = min(xs) / 2, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    for m, mm in roof["machine"]["matmul"].items():
        f = mm["flops_per_s"]
        ax.plot(grid, [min(f, i * bw) / 1e9 for i in grid], "-", lw=1, label=f"roof, M={m}")
    markers = {
        "plain": "o",
        "certificate": "s",
        "certificate+oracle": "^",
        "certificate+oracle, torch ops": "v",
    }
    for r in rows:
        ax.scatter(
            r["intensity"],
            r["achieved_flops_per_s"] / 1e9,
            marker=markers.get(r["config"], "o"),
            s=25,
            c=f"C{sorted({x['variants'] for x in rows}).index(r['variants'])}",
        )
        ax.annotate(
            f"{r['variants']}v/{r['tokens'] // 1024}k", (r["intensity"], r["achieved_flops_per_s"] / 1e9), fontsize=5
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="arithmetic intensity (flop / byte)",
        ylabel="GFLOP/s",
        title="decode step on the measured roofline",
    )
    ax.legend(fontsize=7)
    ax = axes[1]
    for cfg, mk in markers.items():
        for n in sorted({r["tokens"] for r in rows}):
            pts = sorted((r["variants"], r["multiple"]) for r in rows if r["tokens"] == n and r["config"] == cfg)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mk, label=f"{cfg}, {n} tokens")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="variants",
        ylabel="measured step / limit",
        title="how far from the machine's limit",
    )
    ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
