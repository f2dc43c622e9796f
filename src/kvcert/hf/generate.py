"""One example: a single full prefill, every policy built from it, all variants decoded together as one batch.

Flow: record the prompt with exact attention in two chunks (context, then question), keeping full keys/values (the
oracle) and the window queries -> question-aware variants (and the full-cache reference) are compressed over the
whole prompt and take their first token from the full prefill (compression happens after the prefill, as in
kvpress); question-agnostic variants are compressed over the context only and read the question through their
compressed caches -> greedy decoding of every variant in one batch, with per step, layer and query head the
certificate variance, the oracle error, the output norm, the tail attention mass and the largest weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcert.core.hajek import gather_tokens
from kvcert.hf.attention import forward_with_state, use_kvcert_attention
from kvcert.hf.policy import Compressed, Policy, compress
from kvcert.hf.state import KVState, LayerBuffers, StepStats

STAT_NAMES = ("variance", "error", "out_norm", "tail_mass", "p_max")


@dataclass
class VariantResult:
    policy: Policy
    tokens: list[int]  # generated tokens, answer first
    logprobs: list[float]  # log-probability of each generated token under the variant
    n_answer: int  # tokens before EOS / stop string
    answer: str
    kept_tokens: float
    stats: dict[str, np.ndarray]  # name -> (n_answer, layers, query heads), float32; missing when not computed


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int = 16
    stop_strings: tuple[str, ...] = ()
    oracle: bool = True
    certificate: bool = True
    context_window: int = 32  # window of the question-agnostic scorer (last context tokens)
    pool_kernel: int = 5


def _attn_scale(model) -> float:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return float(getattr(model.model.layers[0].self_attn, "scaling", head_dim**-0.5))


def _build_state(
    comps: list[Compressed], full_keys, full_values, region: int, extra: int, oracle: bool, policies: list[Policy]
) -> KVState:
    n_layers = len(full_keys)
    state = KVState(n_layers, "compressed")
    dev = full_keys[0].device
    for layer in range(n_layers):
        k_full, v_full = full_keys[layer][0], full_values[layer][0]  # (Hkv, n, d)
        n_kv, _, d = k_full.shape
        width = max(c.indices[layer].shape[-1] for c in comps)
        slots = max(c.tail_slots[layer] for c in comps)
        b = len(comps)
        keys = torch.zeros(b, n_kv, width + extra, d, dtype=k_full.dtype, device=dev)
        values = torch.zeros_like(keys)
        offset = torch.full((b, n_kv, width + extra), float("-inf"), dtype=torch.float32, device=dev)
        omp = torch.zeros(b, n_kv, slots, dtype=torch.float32, device=dev)
        for row, c in enumerate(comps):
            idx = c.indices[layer]
            m = idx.shape[-1]
            keys[row, :, :m] = gather_tokens(k_full, idx)
            values[row, :, :m] = gather_tokens(v_full, idx)
            offset[row, :, :m] = c.offset[layer]
            ts = c.tail_slots[layer]
            omp[row, :, :ts] = c.one_minus_pi[layer]
        vsq = values[:, :, :slots].float().square().sum(-1)
        state.layers[layer] = LayerBuffers(
            keys, values, offset, omp, vsq, slots, width, width  # offsets and 1 - pi stay fp32 (exact under bf16)
        )
    if oracle:
        state.oracle_keys = [k[:, :, :region] for k in full_keys]
        state.oracle_values = [v[:, :, :region] for v in full_values]
    state.certificate_rows = torch.tensor([p.has_certificate for p in policies], device=dev)
    return state


def _answer_length(tokenizer, tokens: list[int], eos: set[int], stops: tuple[str, ...]) -> tuple[int, str]:
    n = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    if tokenizer is None:
        return n, " ".join(map(str, tokens[:n]))
    text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    if cut < 0:
        return n, text.strip()
    for k in range(1, n + 1):  # first token count whose text reaches the stop string
        if any(s in tokenizer.decode(tokens[:k], skip_special_tokens=True) for s in stops if s):
            return k - 1, text[:cut].strip()
    return n, text[:cut].strip()


def _decode(model, tokenizer, state: KVState, first_logits, start_pos: int, policies, comps, opts, eos, on_step=None):
    bsz = first_logits.shape[0]
    dev = first_logits.device
    logp = first_logits.float().log_softmax(-1)
    tok = logp.argmax(-1)
    tokens, logprobs = [tok], [logp.gather(-1, tok[:, None])[:, 0]]
    done = torch.zeros(bsz, dtype=torch.bool)
    steps: list[dict[str, torch.Tensor]] = []
    state.compute_certificate = opts.certificate
    for step in range(opts.max_new_tokens):
        fed = tokens[-1].cpu().tolist()
        for row in range(bsz):
            if fed[row] in eos:
                done[row] = True
            elif opts.stop_strings and tokenizer is not None and not done[row]:
                text = tokenizer.decode([int(t[row]) for t in tokens], skip_special_tokens=True)
                done[row] = any(s in text for s in opts.stop_strings if s)
        if done.all():
            break
        state.stats = StepStats()
        pos = torch.full((bsz, 1), start_pos + step, device=dev, dtype=torch.long)
        logits = forward_with_state(model, tokens[-1][:, None], pos, state)
        if on_step is not None:
            on_step(step)
        steps.append({k: torch.stack(v, 0) for k, v in vars(state.stats).items() if v})  # (L, B, Hq)
        if step + 1 < opts.max_new_tokens:
            logp = logits.float().log_softmax(-1)
            tok = logp.argmax(-1)
            tokens.append(tok)
            logprobs.append(logp.gather(-1, tok[:, None])[:, 0])
    state.stats = None
    toks = torch.stack(tokens, 1).cpu().tolist()
    lps = torch.stack(logprobs, 1).cpu().tolist()
    results = []
    for row, (policy, comp) in enumerate(zip(policies, comps)):
        n_ans, answer = _answer_length(tokenizer, toks[row], eos, opts.stop_strings)
        stats = {}
        for name in STAT_NAMES:
            if steps and name in steps[0]:
                arr = torch.stack([s[name][:, row] for s in steps[:n_ans]], 0) if n_ans else None
                stats[name] = (arr.float().cpu().numpy() if arr is not None
                               else np.zeros((0,) + tuple(steps[0][name].shape[::2]), np.float32))
        results.append(VariantResult(policy, toks[row], lps[row], n_ans, answer, comp.kept_tokens, stats))
    return results


@torch.no_grad()
def generate_variants(
    model,
    tokenizer,
    input_ids: list[int],
    question_start: int,
    policies: list[Policy],
    *,
    example_id: str,
    options: DecodeOptions = DecodeOptions(),
    on_step=None,
) -> list[VariantResult]:
    """Decode every policy from one shared prefill; results in the order of `policies`. `on_step(step)` is called
    right after each decode step's forward (benchmark timing)."""
    use_kvcert_attention(model)
    dev = model.device
    n, qs = len(input_ids), question_start
    if not 0 < qs < n:
        raise ValueError(f"question_start must be inside the prompt (0 < {qs} < {n})")
    n_layers = model.config.num_hidden_layers
    ctx_w = min(options.context_window, qs - 1)
    record = KVState(n_layers, "record", capture={"question": slice(qs, n), "context": slice(qs - ctx_w, qs)})
    ids = torch.tensor([input_ids], device=dev)
    pos = torch.arange(n, device=dev)[None]
    forward_with_state(model, ids[:, :qs], pos[:, :qs], record)
    full_logits = forward_with_state(model, ids[:, qs:], pos[:, qs:], record)
    scale = _attn_scale(model)
    eos = _eos_ids(model, tokenizer)
    out: dict[int, VariantResult] = {}
    aware = [i for i, p in enumerate(policies) if p.question_aware]
    agnostic = [i for i, p in enumerate(policies) if not p.question_aware]
    if aware:
        group = [policies[i] for i in aware]
        comps = [
            compress(p, record.full_keys, n, (qs, n) if p.scorer == "window_question" else None,
                     record.captured["question"], scale, example_id, options.pool_kernel)
            for p in group
        ]
        state = _build_state(comps, record.full_keys, record.full_values, n, options.max_new_tokens + 1,
                             options.oracle, group)
        first = full_logits.expand(len(group), -1)
        for i, r in zip(aware, _decode(model, tokenizer, state, first, n, group, comps, options, eos, on_step)):
            out[i] = r
    if agnostic:
        group = [policies[i] for i in agnostic]
        comps = [
            compress(p, record.full_keys, qs, (qs - ctx_w, qs), record.captured["context"], scale, example_id,
                     options.pool_kernel)
            for p in group
        ]
        state = _build_state(comps, record.full_keys, record.full_values, qs, n - qs + options.max_new_tokens + 1,
                             options.oracle, group)
        b = len(group)
        first = forward_with_state(model, ids[:, qs:].expand(b, -1), pos[:, qs:].expand(b, -1), state)
        for i, r in zip(agnostic, _decode(model, tokenizer, state, first, n, group, comps, options, eos, on_step)):
            out[i] = r
    return [out[i] for i in range(len(policies))]


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return ids
