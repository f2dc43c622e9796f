"""How one policy compresses the recorded prompt: scores from the registered scorer, a draw from the registered
design, and the tokens that are always kept (the observation window, or the protected question).

Budget accounting: a budget is a fraction of the tokens in the cache at compression time (`region`: the whole
prompt when compress_after=prompt, the context when compress_after=context); the always-kept tokens count against
it and the design draws the rest from the candidates before them.

Two ways in, one selection: `compress` takes every layer's keys at once (verification mode: the full prompt is kept
for the oracle anyway), `select_layers` any subset of layers (serving mode compresses each layer inside its prefill
forward). A policy's random numbers (`PolicyDraws`) are drawn up front for every layer, in the order the all-layer
call draws them, so both keep exactly the same tokens for the same keys.

Head-wise budgets (`Policy.allocation="adakv"`): the heads of a layer keep different counts; every layer's kept
tokens are padded to its widest head (padding: index 0, offset -inf, never attended) and the decode buffers to the
widest row (kvcert.hf.compressed_batch), so the memory held (`kvcert.serve.generate.kv_bytes`) counts that padding.

Sliding-window layers (Gemma 2/3, Mistral-style, gpt-oss-style alternating layers) are not compressed: their window
already bounds their cache, so they keep exactly the last `window - 1` tokens before the next position (every
policy, pi = 1, no certificate), and a budget applies to the full-attention layers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.core import get_design, keep_count
from kvcert.core.allocation import allocate
from kvcert.core.designs import DESIGN_SPECS
from kvcert.core.probabilities import uniform_draws
from kvcert.core.scorers import SCORERS, ScorerInputs, random_scores
from kvcert.core.selection import descending_order
from kvcert.policy import Policy


@dataclass(frozen=True, kw_only=True)
class Compressed:
    """Per layer: kept positions (Hkv, m) into the recorded prompt, offsets, 1 - pi of the tail slots; one policy."""

    indices: list[torch.Tensor]
    offset: list[torch.Tensor]
    one_minus_pi: list[torch.Tensor]
    tail_slots: list[int]
    kept_tokens: float | int  # mean kept prompt tokens per (layer, head) of the budget's (full-attention) layers


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a policy keeps of a prompt, before any key is seen: candidates [0, lo), always kept [lo, hi)."""

    region: int
    lo: int
    hi: int
    n_keep: int  # tokens the design draws from the candidates

    @classmethod
    def of(cls, policy: Policy, *, region: int, forced: tuple[int, int] | None) -> Plan:
        lo, hi = forced if forced is not None else (region, region)
        return cls(region=region, lo=lo, hi=hi, n_keep=min(lo, max(0, keep_count(policy.budget, region) - (hi - lo))))


@dataclass(frozen=True)
class PolicyDraws:
    """A policy's random numbers for every layer: the random scorer's scores (float32), then the design's Poisson
    uniforms (float64), each (layers, Hkv, candidates), drawn in that order from the policy's generator."""

    scores: torch.Tensor | None
    tail: torch.Tensor | None

    @classmethod
    def draw(cls, policy: Policy, generator: torch.Generator, shape: tuple[int, int, int]) -> PolicyDraws:
        if policy.is_full:
            return cls(None, None)
        scores = random_scores(shape, generator=generator) if policy.scorer == "random" else None
        tail = uniform_draws(shape, generator) if DESIGN_SPECS[policy.design].random else None
        return cls(scores, tail)

    def take(self, layers: list[int]) -> PolicyDraws:
        """The draws of some layers (a layer-by-layer compression takes one at a time)."""
        return PolicyDraws(*(None if t is None else t[layers] for t in (self.scores, self.tail)))


@dataclass(frozen=True, kw_only=True)
class LayerKept:
    """One layer's kept tokens for one policy: positions (Hkv, m), offsets (Hkv, m), 1 - pi (Hkv, tail_slots)."""

    indices: torch.Tensor
    offset: torch.Tensor
    one_minus_pi: torch.Tensor
    tail_slots: int
    drawn: torch.Tensor | None  # (Hkv,) tokens the design kept (None: a sliding-window layer, outside the budget)


def select_layers(
    policy: Policy,
    keys: torch.Tensor,
    *,
    layers: list[int],
    plan: Plan,
    window_queries: torch.Tensor | None,
    scale: float,
    draws: PolicyDraws,
    pool_kernel: int = 5,
    layer_windows: list[int | None] | None = None,
    score_cache: dict | None = None,
    inputs: ScorerInputs | None = None,
) -> list[LayerKept]:
    """The kept tokens of `layers` (model indices) from their keys (len(layers), Hkv, >= lo, d) and, for window
    scorers, the window's queries (len(layers), Hq, w, d); `inputs` (the same layers' region) for the scorers that
    read it (ScorerSpec.reads_inputs: the ones ported from kvpress)."""
    n_layers, n_kv = len(layers), keys.shape[1]
    device = keys.device
    region = plan.region
    if policy.is_full:  # every token (a sliding-window layer's mask hides those that left its window)
        idx = torch.arange(region, device=device).expand(n_kv, region)
        zeros = torch.zeros(n_kv, region, device=device)
        counts = torch.full((n_kv,), region, device=device)
        return [LayerKept(indices=idx, offset=zeros, one_minus_pi=zeros[:, :0], tail_slots=0, drawn=counts)] * n_layers
    scores = _scores(policy, keys, plan, window_queries, scale, draws, pool_kernel, score_cache, inputs, layers)
    # the per-head counts (uniform: plan.n_keep for every head; adakv: shared by score mass within each layer)
    n_keep = allocate(policy.allocation, scores, plan.n_keep)
    sel = _design(policy, scores, n_keep, draws.tail)
    omp = sel.one_minus_pi[..., : sel.tail_slots]
    width, slots = [sel.indices.shape[-1]] * n_layers, [sel.tail_slots] * n_layers
    return _layers_kept(sel.indices, sel.offset, omp, width, slots, sel.kept_counts, plan, layers, layer_windows)


def group_key(policy: Policy, plan: Plan, read: tuple[int, int] | None) -> tuple | None:
    """Policies with equal keys (same scorer, candidates, design and its parameters; any budget) select in one design
    call (`select_layers_together`); None: the policy selects alone."""
    spec = SCORERS.get(policy.scorer)
    if policy.is_full or spec is None or policy.scorer == "random" or spec.reads_budget:
        return None
    if policy.allocation != "uniform" or policy.design not in GROUPED_DESIGNS:
        return None
    return (policy.scorer, policy.design, policy.tail_fraction, policy.floor, policy.score_power, policy.half,
            plan.lo, plan.hi, plan.region, read)  # fmt: skip


GROUPED_DESIGNS = ("topk", "randomized")  # designs whose rows are independent given their count and uniforms


def select_layers_together(
    policies: list[Policy],
    plans: list[Plan],
    keys: torch.Tensor,
    *,
    layers: list[int],
    window_queries: torch.Tensor | None,
    scale: float,
    draws: list[PolicyDraws],
    pool_kernel: int = 5,
    layer_windows: list[int | None] | None = None,
    score_cache: dict | None = None,
    inputs: ScorerInputs | None = None,
) -> list[list[LayerKept]]:
    """`select_layers` for policies of one `group_key`, in one design call: the shared scores are repeated once per
    policy along the heads, each policy's rows with its own count and its own uniforms, and the selection is split
    back, each policy's part cut to its own width and tail length. A design's rows are independent given their count
    and uniforms, and the tail-first order of a row does not depend on the other rows, so every policy keeps exactly
    the tokens, offsets and 1 - pi of its own `select_layers` call; the per-call work is done once per group."""
    first = policies[0]
    scores = _scores(first, keys, plans[0], window_queries, scale, draws[0], pool_kernel, score_cache, inputs, layers)
    return select_together(policies, plans, scores, draws=draws, layers=layers, layer_windows=layer_windows)


def select_together(
    policies: list[Policy],
    plans: list[Plan],
    scores: torch.Tensor,
    *,
    draws: list[PolicyDraws],
    layers: list[int],
    layer_windows: list[int | None] | None = None,
    order: torch.Tensor | None = None,
) -> list[list[LayerKept]]:
    """`select_layers_together` from the group's scores (len(layers), Hkv, candidates), as `_scores` returns them:
    any number of layers in one design call (the serving read of many policies selects every layer at once, after
    the read). Each policy's part is cut per layer to that layer's own width and tail length, so a layer keeps the
    positions, offsets, 1 - pi and padding of a call on that layer alone. The scores are sorted once for all the
    policies (order: their `descending_order`, when the caller has it)."""
    first, n_kv = policies[0], scores.shape[1]
    n_pol = len(policies)
    counts = torch.tensor([plan.n_keep for plan in plans], device=scores.device).repeat_interleave(n_kv)
    stacked = scores.repeat(1, n_pol, 1)  # (layers, P * Hkv, candidates)
    n_keep = counts.expand(stacked.shape[:-1]).contiguous()
    tail = None if draws[0].tail is None else torch.cat([d.tail for d in draws], dim=1)
    order = descending_order(scores) if order is None else order
    sel = _design(first, stacked, n_keep, tail, order.repeat(1, n_pol, 1))
    omp_all = sel.one_minus_pi
    out = []
    for p, plan in enumerate(plans):
        rows = slice(p * n_kv, (p + 1) * n_kv)
        kept, tails = sel.kept_counts[:, rows], sel.tail_counts[:, rows]
        widths = kept.amax(-1).tolist() if kept.numel() else [0] * len(layers)
        slots = tails.amax(-1).tolist() if kept.numel() else [0] * len(layers)
        out.append(_layers_kept(sel.indices[:, rows], sel.offset[:, rows], omp_all[:, rows], widths, slots, kept,
                                plan, layers, layer_windows))  # fmt: skip
    return out


def _layers_kept(
    indices, offset, omp, widths, slots, kept_counts, plan: Plan, layers, layer_windows
) -> list[LayerKept]:
    """A selection (len(layers), Hkv, m) as one LayerKept per layer, each cut to its own width and tail length and
    followed by the always-kept tokens (a sliding-window layer keeps its window exactly instead). The layers are
    written into one tensor (len(layers), Hkv, max width + always-kept), so a layer costs a few operations, and each
    LayerKept is a view of its layer's part."""
    n_layers, n_kv = indices.shape[0], indices.shape[1]
    lo, hi, region = plan.lo, plan.hi, plan.region
    n_forced, top = hi - lo, max(widths, default=0)
    all_indices = indices.new_zeros(n_layers, n_kv, top + n_forced)
    all_offset = offset.new_zeros(n_layers, n_kv, top + n_forced)
    all_indices[..., :top], all_offset[..., :top] = indices[..., :top], offset[..., :top]
    always = torch.arange(lo, hi, device=indices.device)
    windows = [layer_windows[i] for i in layers] if layer_windows else [None] * n_layers
    out = []
    parts = zip(all_indices.unbind(0), all_offset.unbind(0), omp.unbind(0), kept_counts.unbind(0), widths, slots)
    for window, (ind, off, tail_omp, drawn, width, slot) in zip(windows, parts):
        if window is not None:  # keep the window exactly
            lo_w = max(0, region - (window - 1))
            idx = torch.arange(lo_w, region, device=indices.device).expand(n_kv, region - lo_w)
            zeros = torch.zeros(n_kv, region - lo_w, device=indices.device)
            out.append(LayerKept(indices=idx, offset=zeros, one_minus_pi=zeros[:, :0], tail_slots=0, drawn=None))
            continue
        if n_forced:
            ind[:, width : width + n_forced], off[:, width : width + n_forced] = always, 0.0
        m = width + n_forced
        out.append(LayerKept(indices=ind[:, :m], offset=off[:, :m], one_minus_pi=tail_omp[:, :slot], tail_slots=slot,
                             drawn=drawn))  # fmt: skip
    return out


def _scores(policy, keys, plan, window_queries, scale, draws, pool_kernel, score_cache, inputs, layers) -> torch.Tensor:
    """The policy's scores of its candidates (len(layers), Hkv, lo), float32 and >= 0, shared through score_cache."""
    lo, hi = plan.lo, plan.hi
    # scores depend on the scorer, the candidates and the layers only, so policies that differ in design or budget
    # share them (random scores are the policy's own draws and never shared)
    spec = SCORERS.get(policy.scorer)
    key = (policy.scorer, lo, (lo, hi), pool_kernel, tuple(layers))
    if spec is not None and spec.reads_budget:
        key += (plan.n_keep,)
    scores = score_cache.get(key) if score_cache is not None and policy.scorer != "random" else None
    if scores is None:
        if policy.scorer == "random":
            scores = draws.scores.to(keys.device)
        elif spec.reads_inputs:  # the ported kvpress scorers: the layer's whole cache and model tensors too
            if inputs is None:
                raise ValueError(f"scorer {policy.scorer!r} needs the layers' ScorerInputs")
            scores = spec.score(
                keys[:, :, :lo],
                window_queries=window_queries,
                scale=scale,
                pool_kernel=pool_kernel,
                generator=None,
                inputs=inputs,
                n_keep=plan.n_keep,
                n_forced=hi - lo,
            )
        else:  # the original scorers: called exactly as before
            scores = spec.score(
                keys[:, :, :lo], window_queries=window_queries, scale=scale, pool_kernel=pool_kernel, generator=None
            )
        if score_cache is not None and policy.scorer != "random":
            score_cache[key] = scores
    return scores.float().clamp_min(0)


def _design(policy: Policy, scores: torch.Tensor, n_keep, uniforms: torch.Tensor | None, order=None):
    extra = {} if policy.half is None else {"half": policy.half}  # only the randomized design splits its tail
    if order is not None:
        extra["order"] = order
    return get_design(policy.design)(
        scores,
        n_keep,
        tail_fraction=policy.tail_fraction,
        floor=policy.floor,
        score_power=policy.score_power,
        generator=None,
        draws=uniforms,
        **extra,
    )


def assemble_layers(policy: Policy, plan: Plan, layers: list[LayerKept]) -> Compressed:
    """Every layer's kept tokens as one policy's Compressed; kept_tokens is the mean over the budget's layers."""
    if policy.is_full:
        kept = plan.region
    else:
        drawn = [k.drawn for k in layers if k.drawn is not None]
        # drawn tokens (layers, Hkv) as float64, + the forced ones after the mean (float order)
        kept = float(torch.stack(drawn).double().mean()) + (plan.hi - plan.lo) if drawn else float("nan")
    return Compressed(
        indices=[k.indices for k in layers],
        offset=[k.offset for k in layers],
        one_minus_pi=[k.one_minus_pi for k in layers],
        tail_slots=[k.tail_slots for k in layers],
        kept_tokens=kept,
    )


def compress(
    policy: Policy,
    full_keys: list[torch.Tensor],
    *,
    region: int,
    forced: tuple[int, int] | None,
    window_queries: list[torch.Tensor] | None,
    scale: float,
    generator: torch.Generator,
    pool_kernel: int = 5,
    layer_windows: list[int | None] | None = None,
    score_cache: dict | None = None,
    inputs: ScorerInputs | None = None,
) -> Compressed:
    """Select the kept prompt tokens of every layer at once.

    region: tokens [0, region) of the recorded keys are the prompt at compression time.
    forced: (lo, hi) positions always kept (the observation window or the protected question), excluded from the
    candidates [0, lo); the budget (a fraction of `region`) counts them. None: every token is a candidate.
    inputs: every layer's region for the scorers that read it (kvcert.hf.scorer_inputs), else None.
    """
    plan = Plan.of(policy, region=region, forced=forced)
    n_layers, n_kv = len(full_keys), full_keys[0].shape[1]
    draws = PolicyDraws.draw(policy, generator, (n_layers, n_kv, plan.lo))
    if policy.is_full:  # nothing to score: an empty view stands for the keys
        keys = full_keys[0][0, :, :0].expand(n_layers, -1, -1, -1)
    else:
        keys = torch.stack([k[0, :, : plan.lo] for k in full_keys])  # (L, Hkv, candidates, d)
    queries = torch.stack([w[0] for w in window_queries]) if window_queries is not None else None  # (L, Hq, w, d)
    kept = select_layers(
        policy,
        keys,
        layers=list(range(n_layers)),
        plan=plan,
        window_queries=queries,
        scale=scale,
        draws=draws,
        pool_kernel=pool_kernel,
        layer_windows=layer_windows,
        score_cache=score_cache,
        inputs=inputs,
    )
    return assemble_layers(policy, plan, kept)
