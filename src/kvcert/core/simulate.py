"""Random attention problems and Monte Carlo over design draws: the certificate checked against the truth.

Used by the tests, by the T1 demonstration and to document where the certificate can and cannot be trusted
(SPEC section 2: well-scored, mis-scored and very peaked regimes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.core.certificate import tail_diagnostics, trace_c2_exact
from kvcert.core.designs import get_design
from kvcert.core.hajek import certificate_radius, exact_attention, gather_tokens, hajek_attention
from kvcert.core.sketch import make_sketch, sketch_tail, sketched_trace_c2


@dataclass(frozen=True)
class AttentionProblem:
    query: torch.Tensor  # (d,) the decode query
    keys: torch.Tensor  # (n, d)
    values: torch.Tensor  # (n, d)
    scores: torch.Tensor  # (n,) what the scorer saw (attention of a window query)
    scale: float


def random_problem(
    n: int = 1000,
    d: int = 64,
    *,
    peakedness: float = 1.0,
    window_noise: float = 0.3,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float64,
) -> AttentionProblem:
    """Gaussian keys/values; the scorer's window query = decode query + noise (window_noise 0 = perfect scorer).

    peakedness scales the logits: 1 gives moderately spread attention, 4+ gives a few dominant tokens.
    """
    keys = torch.randn(n, d, generator=generator, dtype=dtype)
    values = torch.randn(n, d, generator=generator, dtype=dtype)
    query = torch.randn(d, generator=generator, dtype=dtype) * peakedness
    noise = torch.randn(d, generator=generator, dtype=dtype) * query.norm() / d**0.5
    window_query = query + window_noise * noise
    scale = d**-0.5
    scores = (keys @ window_query * scale).softmax(-1)
    return AttentionProblem(query, keys, values, scores, scale)


def monte_carlo(
    problem: AttentionProblem,
    *,
    design: str = "randomized",
    budget: float = 0.5,
    tail_fraction: float = 0.5,
    floor: float = 0.2,
    score_power: float = 1.0,
    draws: int = 2000,
    level: float = 0.95,
    generator: torch.Generator,
    values: torch.Tensor | None = None,
    moments: bool = False,
    sketch_k: int = 0,
) -> dict[str, float | torch.Tensor]:
    """Draw the design `draws` times on one problem; return coverage, E[V_hat]/MSE, bias and the raw draws.

    values overrides problem.values (the T1 perturbation changes values, never the scores or the draw).
    moments: also return per draw the exact tr(C_hat^2) ("trace_c2") and the per-cell diagnostics of
    kvcert.core.certificate.tail_diagnostics (tail_mass, ess_tail, n_tail, tail_max, head_mass, p_max);
    sketch_k > 0 adds the sketched estimate ("trace_c2_sketch", a fresh Gaussian sketch of k columns).
    """
    v = problem.values if values is None else values
    n = problem.keys.shape[0]
    n_keep = round(budget * n)
    select = get_design(design)
    sel = select(
        problem.scores.expand(draws, n).contiguous(),
        n_keep,
        tail_fraction=tail_fraction,
        floor=floor,
        score_power=score_power,
        generator=generator,
    )
    k = gather_tokens(problem.keys.expand(draws, n, -1), sel.indices)
    vv = gather_tokens(v.expand(draws, n, -1), sel.indices)
    q = problem.query.expand(draws, 1, -1)
    omp = sel.one_minus_pi.to(v.dtype) if sel.has_certificate else None
    res = hajek_attention(q, k, vv, sel.offset.to(v.dtype), scale=problem.scale, one_minus_pi=omp)
    exact = exact_attention(problem.query[None, None], problem.keys[None], v[None], scale=problem.scale)[0, 0]
    est = res.output[:, 0]
    sq_err = (est - exact).square().sum(-1)
    out = {
        "mse": float(sq_err.mean()),
        "bias_norm": float((est.mean(0) - exact).norm()),
        "bias_se": float(est.std(0).norm() / draws**0.5),
        "exact_norm": float(exact.norm()),
        "sq_err": sq_err,
        "kept_mean": float(sel.kept_counts.double().mean()),
    }
    if res.variance is not None:
        var = res.variance[:, 0]
        out["mean_vhat"] = float(var.mean())
        out["vhat_over_mse"] = float(var.mean() / sq_err.mean())
        out["coverage"] = float((sq_err.sqrt() <= certificate_radius(var, level)).double().mean())
        out["variance"] = var
        if moments:
            w, o = res.weights, res.output
            s = sel.tail_slots
            tc2 = torch.cat(
                [
                    trace_c2_exact(w[i : i + 100], vv[i : i + 100], o[i : i + 100], omp[i : i + 100], tail_slots=s)
                    for i in range(0, draws, 100)
                ]
            )[:, 0]
            out["trace_c2"] = tc2
            diag = tail_diagnostics(w, omp, tail_slots=s)
            out.update({name: t[:, 0] for name, t in diag.items()})
            out["p_max"] = w.amax(-1)[:, 0]
            if sketch_k:
                r = make_sketch(v.shape[-1], sketch_k, generator=generator, dtype=v.dtype)
                vs = sketch_tail(vv[:, :s], r)
                out["trace_c2_sketch"] = sketched_trace_c2(w, omp, vs, o, r, res.variance)[:, 0]
    return out


REGIMES = {
    "well-scored": dict(peakedness=1.5, window_noise=0.3),
    "mis-scored": dict(peakedness=2.0, window_noise=3.0),
    "very peaked": dict(peakedness=6.0, window_noise=0.3),
}


#: regimes that reproduce study 1's failure pattern (coverage falls with the tail's mass and effective sample size):
#: well-scored as above; mis-scored (tail tokens with real mass but small pi); very peaked (tail mass ~3e-4, ESS ~6);
#: peaked and mis-scored (a handful of tail tokens with tiny pi carry ~10% of the mass, ESS ~2)
FAILURE_REGIMES = {
    "well-scored": dict(peakedness=1.5, window_noise=0.3),
    "mis-scored": dict(peakedness=2.0, window_noise=3.0),
    "very peaked": dict(peakedness=8.0, window_noise=0.3),
    "peaked, mis-scored": dict(peakedness=6.0, window_noise=1.5),
}


def regime_table(seeds=(1, 2, 3), budgets=(0.25, 0.5), floors=(0.2, 0.5), draws: int = 1000) -> list[dict]:
    """Coverage and E[V_hat]/MSE per regime, budget and floor (n = 1000, d = 64): the README's table."""
    rows = []
    for name, kw in REGIMES.items():
        for budget in budgets:
            for floor in floors:
                cov, ratio = [], []
                for seed in seeds:
                    g = torch.Generator().manual_seed(seed)
                    r = monte_carlo(
                        random_problem(generator=g, **kw), budget=budget, floor=floor, draws=draws, generator=g
                    )
                    cov.append(r["coverage"])
                    ratio.append(r["vhat_over_mse"])
                rows.append(
                    {
                        "regime": name,
                        "budget": budget,
                        "floor": floor,
                        "coverage_min": min(cov),
                        "coverage_max": max(cov),
                        "ratio_min": min(ratio),
                        "ratio_max": max(ratio),
                    }
                )
    return rows


def regime_cells(r: dict) -> list[str]:
    """One row of the README's regime table, as printed: regime, budget, floor, coverage range, E[V_hat]/MSE range."""
    cov = f"{r['coverage_min']:.3f}-{r['coverage_max']:.3f}"
    ratio = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
    return [r["regime"], f"{r['budget']:.2f}", f"{r['floor']:.1f}", cov, ratio]


def regime_markdown(cells: list[list[str]]) -> str:
    """The README's regime table from rows of regime_cells (kvcert.analysis.tables.markdown_table)."""
    import pandas as pd  # here: kvcert.core needs neither pandas nor the analysis package to compute

    from kvcert.analysis.tables import markdown_table

    header = ["regime", "budget", "floor", "coverage of the 95% radius", "E[V_hat] / MSE"]
    return markdown_table(pd.DataFrame(cells, columns=header), parse_numbers=False)


if __name__ == "__main__":
    print(regime_markdown([regime_cells(r) for r in regime_table()]))
