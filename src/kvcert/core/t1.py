"""T1, non-identifiability demonstrated on a random attention problem (plain torch, no transformers).

Deterministic top-k: every evicted value is pushed by lambda * u (u: the direction of the current error). The
retained keys and values stay bit-identical, so any estimate computed from them (here the certificate, 0 for
top-k) is constant, while the true error grows with lambda. Randomized design (head + Poisson tail with offset):
the same push applied to every non-head token, independent of the draw; over design draws the mean V_hat tracks
the mean squared error as lambda grows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcert.core import evicted_mask, exact_attention, gather_tokens, get_design, hajek_attention, perturb_values
from kvcert.core.selection import split_head_tail
from kvcert.core.simulate import monte_carlo, random_problem

T1_KEYS = (
    "lambda",
    "true_error_deterministic",
    "estimate_deterministic",
    "retained_identical",
    "mse_randomized",
    "mean_vhat_randomized",
    "coverage_randomized",
)


def t1_demonstration(
    *,
    lambdas: Sequence[float],
    n: int,
    d: int,
    budget: float,
    peakedness: float,
    draws: int,
    seed: int,
    tail_fraction: float,
    floor: float,
    score_power: float,
) -> dict[str, list]:
    """Per lambda: the deterministic design's true error, its estimate and whether its retained data are
    unchanged; the randomized design's MSE, mean V_hat and coverage over `draws` design draws."""
    g = torch.Generator().manual_seed(int(seed))
    p = random_problem(n=int(n), d=int(d), peakedness=float(peakedness), generator=g)
    n_keep = round(float(budget) * int(n))
    det = get_design("topk")(p.scores[None], n_keep)
    evicted = evicted_mask(det.indices, det.valid, int(n))[0]
    kept_k = gather_tokens(p.keys[None], det.indices)

    def det_output(values):
        kept_v = gather_tokens(values[None], det.indices)
        res = hajek_attention(
            p.query[None, None],
            kept_k,
            kept_v,
            det.offset.double(),
            scale=p.scale,
            one_minus_pi=det.one_minus_pi.double(),
        )
        return res.output[0, 0], float(res.variance[0, 0]), kept_v

    o0, _, _ = det_output(p.values)
    exact0 = exact_attention(p.query[None, None], p.keys[None], p.values[None], scale=p.scale)[0, 0]
    # push the evicted values along the current error: the true error then grows monotonically with lambda
    direction = (exact0 - o0) / (exact0 - o0).norm()
    n_head, _ = split_head_tail(n_keep, float(tail_fraction))
    non_head = torch.ones(int(n), dtype=torch.bool)
    non_head[p.scores.topk(n_head).indices] = False
    out: dict[str, list] = {k: [] for k in T1_KEYS}
    _, _, kept_ref = det_output(p.values)
    for lam in lambdas:
        v_det = perturb_values(p.values, evicted, direction, float(lam))
        o_hat, v_hat_det, kept_v = det_output(v_det)
        exact = exact_attention(p.query[None, None], p.keys[None], v_det[None], scale=p.scale)[0, 0]
        v_rand = perturb_values(p.values, non_head, direction, float(lam))
        mc = monte_carlo(
            p,
            budget=float(budget),
            tail_fraction=float(tail_fraction),
            floor=float(floor),
            score_power=float(score_power),
            draws=int(draws),
            generator=torch.Generator().manual_seed(int(seed) + 1),
            values=v_rand,
        )
        out["lambda"].append(float(lam))
        out["true_error_deterministic"].append(float((o_hat - exact).norm()))
        out["estimate_deterministic"].append(v_hat_det)  # the certificate of top-k: 0 whatever lambda is
        out["retained_identical"].append(bool(torch.equal(kept_v, kept_ref)))
        out["mse_randomized"].append(mc["mse"])
        out["mean_vhat_randomized"].append(mc["mean_vhat"])
        out["coverage_randomized"].append(mc["coverage"])
    return out
