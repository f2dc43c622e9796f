"""Choosing a KV budget with a guarantee on the answer-change risk: conformal risk control and Learn-then-Test over
a monotone ladder of budgets (plain numpy and scipy; `kvcert.serve.budget_calibration` collects the losses).

Setting. n calibration prompts, a ladder of budgets b_1 < ... < b_K below the full cache, and per prompt i and rung k a
loss L_i(b_k) in [0, 1]: 1 when the answer at b_k differs from the full cache's ("differs"), or the score the budget
lost against the full cache, max(0, s_full - s_k) ("accuracy"). The full cache's loss is 0 by construction, so it
is the ladder's last rung and always qualifies once n is large enough. Losses are first made monotone in the budget,
L~_i(b_k) = max_{j >= k} L_i(b_j) (a prompt counts as lost at b_k when it is lost at any larger compressed rung):
L~ >= L, so a guarantee on L~ holds for L, and the risk R(b) = E L~(b) is non-increasing in b.

- **CRC** (Angelopoulos, Bates, Fisch, Lei, Schuster 2022, "Conformal Risk Control", Theorem 1 with B = 1): the
  smallest b with (n / (n + 1)) Rhat(b) + 1 / (n + 1) <= alpha. Guarantee in expectation over the calibration draw
  and a new exchangeable prompt: E[L_{n+1}(b_hat)] <= alpha. Needs n >= 1 / alpha - 1 (else not even the full cache,
  Rhat = 0, passes).
- **LTT** (Angelopoulos, Bates, Candes, Jordan, Lei 2021, "Learn then Test"): for each compressed rung the null
  H_k: R(b_k) > alpha, tested with a valid p-value (binary losses: the exact binomial tail P(Binom(n, alpha) <=
  n Rhat); other losses in [0, 1]: the Hoeffding-Bentkus p-value of Bates et al. 2021), by fixed-sequence testing from
  the largest budget down, stopping at the first p > delta; b_hat is the last rejected rung (the full cache when the
  largest is not rejected). Guarantee: P(R(b_hat) <= alpha) >= 1 - delta over the calibration draw. Needs
  (1 - alpha)^n <= delta, n >= log(delta) / log(1 - alpha): the p-value of zero losses.

Both refuse (`RiskControlError`, one line naming the fix) when n is below that minimum, and fall back to the full cache
(`Selection.fallback`, with the reason) when no compressed rung qualifies. `select_groups` applies the same rule per
group (each group its own guarantee and its own refusal) beside the pooled one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.stats import binom

METHODS = ("ltt", "crc")
FULL_BUDGET = 1.0


class RiskControlError(ValueError):
    """Too few calibration prompts for the requested guarantee: one line naming the fix."""


@dataclass
class Selection:
    method: str
    alpha: float
    delta: float | None  # LTT's error probability; None for CRC (a guarantee in expectation)
    n: int
    ladder: list[float]  # the compressed rungs, ascending (the full cache, 1.0, follows them)
    budget: float  # the budget chosen; 1.0: the full cache
    fallback: bool  # no compressed rung qualified: the full cache
    reason: str  # why this budget, in words
    risk: list[float]  # per rung: the empirical risk of the monotone loss L~
    raw_risk: list[float]  # per rung: the empirical risk of the loss itself
    statistic: list[float]  # per rung: CRC's bound (n Rhat + 1) / (n + 1), or LTT's p-value (NaN: not tested)
    pvalue: str = ""  # LTT: "binomial" or "hoeffding-bentkus"
    mean_kv: float | None = None  # mean KV share (of the full cache) the chosen budget holds on these prompts
    refused: str | None = None  # set (and budget 1.0) when n was too small: the one-line refusal
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def monotone(losses) -> np.ndarray:
    """L~[:, k] = max over rungs j >= k of L[:, j] (columns ascending in budget): non-increasing along each row."""
    arr = np.asarray(losses, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"losses must be (prompts, rungs), got shape {arr.shape}")
    if arr.size and (np.nanmin(arr) < 0 or np.nanmax(arr) > 1 or np.isnan(arr).any()):
        raise ValueError("losses must lie in [0, 1] with no NaN")
    return np.maximum.accumulate(arr[:, ::-1], axis=1)[:, ::-1]


def min_n(method: str, alpha: float, delta: float | None = None) -> int:
    """The fewest calibration prompts with which the method can certify anything (the full cache for CRC, the
    largest compressed rung with no loss for LTT)."""
    _check(method, alpha, delta)
    if method == "crc":
        return max(1, math.ceil(1.0 / alpha - 1.0 - 1e-12))
    return math.ceil(math.log(delta) / math.log1p(-alpha) - 1e-12)


def _check(method: str, alpha: float, delta: float | None) -> None:
    if method not in METHODS:
        raise ValueError(f"method {method!r}: choose one of {', '.join(METHODS)}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha {alpha!r} must lie in (0, 1), e.g. 0.1")
    if method == "ltt" and (delta is None or not 0.0 < delta < 1.0):
        raise ValueError(f"delta {delta!r} must lie in (0, 1) for ltt, e.g. 0.1")


def refusal(method: str, n: int, alpha: float, delta: float | None, what: str = "calibration prompts") -> str | None:
    """The one-line refusal when n is below the method's minimum, or None."""
    need = min_n(method, alpha, delta)
    if n >= need:
        return None
    if method == "crc":
        return (f"{n} {what} are too few for crc at alpha={alpha:g}: it needs n >= 1/alpha - 1 = {need}; add "
                f"prompts or raise alpha")  # fmt: skip
    crc = min_n("crc", alpha)
    return (f"{n} {what} are too few for ltt at alpha={alpha:g}, delta={delta:g}: even with no losses it needs "
            f"n >= log(delta)/log(1-alpha) = {need}; add prompts, raise alpha or delta, or use --method crc "
            f"(a guarantee in expectation, n >= {crc})")  # fmt: skip


def binomial_pvalue(risk_hat: float, n: int, alpha: float) -> float:
    """P(Binom(n, alpha) <= n risk_hat): valid for H: R > alpha when the losses are binary."""
    return float(binom.cdf(round(n * risk_hat), n, alpha))


def hb_pvalue(risk_hat: float, n: int, alpha: float) -> float:
    """The Hoeffding-Bentkus p-value for H: R > alpha, losses in [0, 1] (Bates, Angelopoulos, Lei, Malik, Jordan
    2021, "Distribution-free, risk-controlling prediction sets", Proposition 5)."""
    r = min(risk_hat, alpha)
    h = -math.log1p(-alpha) if r <= 0 else r * math.log(r / alpha) + (1 - r) * math.log((1 - r) / (1 - alpha))
    hoeffding = math.exp(-n * h)
    bentkus = math.e * float(binom.cdf(math.ceil(n * risk_hat - 1e-9), n, alpha))
    return min(1.0, hoeffding, bentkus)


def select(losses, ladder, alpha: float, delta: float | None = None, method: str = "ltt", kv=None) -> Selection:
    """The budget for these losses ((prompts, rungs), the rungs of `ladder` ascending, the full cache excluded: its
    loss is 0). kv: optional (prompts, rungs + 1) KV shares (the last column the full cache's, 1) for `mean_kv`.
    Raises RiskControlError (one line) when n is below `min_n`."""
    _check(method, alpha, delta)
    ladder = [float(b) for b in ladder]
    if sorted(ladder) != ladder or len(set(ladder)) != len(ladder) or not all(0 < b < 1 for b in ladder):
        raise ValueError(f"ladder {ladder}: distinct budgets in (0, 1), ascending (the full cache is added)")
    raw = np.asarray(losses, dtype=np.float64).reshape(-1, len(ladder))
    mono = monotone(raw)
    n = mono.shape[0]
    why = refusal(method, n, alpha, delta)
    if why is not None:
        raise RiskControlError(why)
    risk, raw_risk = mono.mean(axis=0), raw.mean(axis=0)
    if method == "crc":
        stat = (n * risk + 1.0) / (n + 1.0)
        ok = [k for k in range(len(ladder)) if stat[k] <= alpha]
        chosen = ok[0] if ok else None  # risk is non-increasing: every larger rung qualifies as well
        pname, kept = "", [float(s) for s in stat]
        rule = f"(n Rhat + 1)/(n + 1) <= alpha={alpha:g}"
    else:
        binary = bool(np.isin(mono, (0.0, 1.0)).all())
        pname = "binomial" if binary else "hoeffding-bentkus"
        pfun = binomial_pvalue if binary else hb_pvalue
        kept, chosen = [math.nan] * len(ladder), None
        for k in reversed(range(len(ladder))):  # fixed sequence: largest budget first, stop at the first non-rejection
            kept[k] = pfun(float(risk[k]), n, alpha)
            if kept[k] > delta:
                break
            chosen = k
        rule = f"{pname} p-value <= delta={delta:g} for risk <= alpha={alpha:g}, tested from the largest budget down"
    if chosen is None:
        budget, fallback = FULL_BUDGET, True
        reason = f"no budget below the full cache qualified ({rule}): the full cache"
    else:
        budget, fallback = ladder[chosen], False
        reason = f"the smallest budget with {rule}"
    out = Selection(method=method, alpha=alpha, delta=delta if method == "ltt" else None, n=n, ladder=ladder,
                    budget=budget, fallback=fallback, reason=reason, risk=[float(r) for r in risk],
                    raw_risk=[float(r) for r in raw_risk], statistic=kept, pvalue=pname)  # fmt: skip
    if kv is not None:
        out.mean_kv = mean_kv(kv, ladder, budget)
    return out


def mean_kv(kv, ladder, budget: float) -> float:
    """Mean over the prompts of the KV share held at `budget` (kv: (prompts, rungs + 1), the last the full cache)."""
    arr = np.asarray(kv, dtype=np.float64).reshape(-1, len(ladder) + 1)
    col = len(ladder) if budget >= FULL_BUDGET else list(ladder).index(budget)
    return float(arr[:, col].mean()) if len(arr) else math.nan


def select_groups(losses, groups, ladder, alpha: float, delta: float | None = None, method: str = "ltt", kv=None):
    """(pooled Selection, {group: Selection}): the rule on all prompts and on each group's own (a group below the
    minimum n is refused: its Selection holds the refusal and the full cache). The pooled refusal raises.
    Also the per-kind mean KV (each prompt at its group's budget) in pooled.extra["per_kind_mean_kv"]."""
    raw = np.asarray(losses, dtype=np.float64).reshape(-1, len(ladder))
    groups = np.asarray(groups, dtype=object)
    kv_arr = None if kv is None else np.asarray(kv, dtype=np.float64).reshape(-1, len(ladder) + 1)
    pooled = select(raw, ladder, alpha, delta, method, kv_arr)
    per: dict[str, Selection] = {}
    for g in sorted(set(groups.tolist()), key=str):
        rows = groups == g
        sub_kv = None if kv_arr is None else kv_arr[rows]
        try:
            per[str(g)] = select(raw[rows], ladder, alpha, delta, method, sub_kv)
        except RiskControlError as err:
            per[str(g)] = _refused(raw[rows], ladder, alpha, delta, method, sub_kv, str(err))
    if kv_arr is not None:
        pooled.extra["per_kind_mean_kv"] = per_kind_kv(kv_arr, groups, ladder, {g: s.budget for g, s in per.items()})
    return pooled, per


def _refused(raw, ladder, alpha, delta, method, kv, why: str) -> Selection:
    """A group with too few prompts: the refusal, its empirical risks, and the full cache."""
    return Selection(
        method=method,
        alpha=alpha,
        delta=delta if method == "ltt" else None,
        n=len(raw),
        ladder=[float(b) for b in ladder],
        budget=FULL_BUDGET,
        fallback=True,
        reason=f"refused: {why}; the full cache",
        risk=[float(r) for r in monotone(raw).mean(axis=0)],
        raw_risk=[float(r) for r in raw.mean(axis=0)],
        statistic=[math.nan] * len(ladder),
        refused=why,
        mean_kv=None if kv is None else mean_kv(kv, ladder, FULL_BUDGET),
    )


def per_kind_kv(kv, groups, ladder, budgets: dict[str, float]) -> float:
    """Mean KV share when each prompt holds its group's budget."""
    cols = [len(ladder) if budgets[str(g)] >= FULL_BUDGET else list(ladder).index(budgets[str(g)]) for g in groups]
    arr = np.asarray(kv, dtype=np.float64)
    return float(arr[np.arange(len(cols)), cols].mean()) if len(cols) else math.nan


def loss_at(losses, ladder, budget: float) -> np.ndarray:
    """Each prompt's loss at a budget of the ladder (0 at the full cache)."""
    arr = np.asarray(losses, dtype=np.float64).reshape(-1, len(ladder))
    return np.zeros(len(arr)) if budget >= FULL_BUDGET else arr[:, list(ladder).index(budget)]


def repeat_splits(losses, groups, ladder, alpha: float, delta: float | None = None, method: str = "ltt", kv=None,
                  *, n_splits: int = 100, cal_share: float = 0.5, seed: int = 0) -> dict:  # fmt: skip
    """Validation by repeated splits: each split draws, within every group, a share `cal_share` of the prompts for
    calibration (the rest test), chooses the pooled and the per-group budgets on the calibration part and measures
    the realized risk (the loss itself, not its monotone bound) and mean KV on the test part: pooled (every prompt at
    the pooled budget) and per kind (every prompt at its group's). Returns the means over splits, the share of splits
    whose realized test risk is within alpha (a noisy estimate of the guarantee's coverage: the test set is finite),
    and per group its mean budget and realized risk."""
    raw = np.asarray(losses, dtype=np.float64).reshape(-1, len(ladder))
    groups = np.asarray(groups, dtype=object)
    kv_arr = np.ones((len(raw), len(ladder) + 1)) if kv is None else np.asarray(kv, dtype=np.float64)
    rng = np.random.default_rng(seed)
    names = sorted(set(groups.tolist()), key=str)
    rows: dict[str, list] = {k: [] for k in ("pooled_risk", "kind_risk", "pooled_kv", "kind_kv", "pooled_budget")}
    per: dict[str, dict[str, list]] = {g: {"budget": [], "risk": []} for g in names}
    for _ in range(n_splits):
        cal = np.zeros(len(raw), dtype=bool)
        for g in names:
            idx = np.flatnonzero(groups == g)
            cal[rng.permutation(idx)[: max(1, round(cal_share * len(idx)))]] = True
        test = ~cal
        pooled, by = select_groups(raw[cal], groups[cal], ladder, alpha, delta, method)
        budgets = [by[str(g)].budget for g in groups[test]]
        t_raw, t_kv = raw[test], kv_arr[test]
        kind_loss = [loss_at(t_raw[i : i + 1], ladder, b)[0] for i, b in enumerate(budgets)]
        rows["pooled_risk"].append(float(loss_at(t_raw, ladder, pooled.budget).mean()))
        rows["kind_risk"].append(float(np.mean(kind_loss)))
        rows["pooled_kv"].append(mean_kv(t_kv, ladder, pooled.budget))
        rows["kind_kv"].append(per_kind_kv(t_kv, groups[test], ladder, {g: s.budget for g, s in by.items()}))
        rows["pooled_budget"].append(pooled.budget)
        for g in names:
            in_g = groups[test] == g
            per[g]["budget"].append(by[str(g)].budget)
            per[g]["risk"].append(float(loss_at(t_raw[in_g], ladder, by[str(g)].budget).mean()))
    summary = {k: float(np.mean(v)) for k, v in rows.items()}
    summary["pooled_within_alpha"] = float(np.mean(np.asarray(rows["pooled_risk"]) <= alpha))
    summary["kind_within_alpha"] = float(np.mean(np.asarray(rows["kind_risk"]) <= alpha))
    summary["groups"] = {g: {"mean_budget": float(np.mean(v["budget"])), "risk": float(np.mean(v["risk"])),
                             "within_alpha": float(np.mean(np.asarray(v["risk"]) <= alpha))}
                         for g, v in per.items()}  # fmt: skip
    return {"method": method, "alpha": alpha, "delta": delta, "n_splits": n_splits, "cal_share": cal_share,
            "n": len(raw), **summary}  # fmt: skip
