"""Greedy decoding of a batch of compressed variants, with the certificate and oracle statistics of every step.

`DecodeOptions` is the one place the decoding defaults live. Four switches only change speed, not results (see
README, Performance): `one_batch` decodes the question-aware and question-agnostic variants as one batch (one
forward per step for all), `drop_finished` compacts finished variants out of the batch so no attention,
certificate or oracle work is spent on them. With either on, a variant's numbers match the unoptimised path to
float tolerance: the matmuls see other batch shapes, so summation orders change (tests/test_hf_decode.py).
The third, `stats_after_forward` (off by default, so the studies' records stay bit for bit), computes the per-step
statistics of all layers in one pass after the forward instead of inside each layer: the same formulas on stacked
tensors, a few dozen kernels per step instead of a few dozen per layer and bucket; `keys_transposed` (off by
default, same reason) stores the compressed keys as (d, slots), so that q K^T is a GEMM without a transposed
operand (1.7-2x faster for this small-M shape with MKL on CPU). The fifth, `fused_attention` (off by default; needs
the two before it, CPU only), runs each layer's single-token step for every bucket as one compiled C++ kernel
(`kvcert.hf.fused`, built on first use with the machine's C++ compiler and ninja) instead of a dozen torch ops per
bucket; same statistics to float rounding. The sixth, `packed_weights` (off by default, CPU), runs the model's
float32 linear layers through MKL's pre-packed GEMM (`kvcert.hf.packed`): bit-identical outputs on this machine's
checks, 1.15-1.35x faster linear layers at decode shapes, at the cost of a packed copy of the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvcert.defaults import DEFAULT_MAX_NEW_TOKENS
from kvcert.hf.attention import CompressedState, StepStats, forward_with_state
from kvcert.policy import Policy

STAT_NAMES = (
    "variance",
    "error",
    "out_norm",
    "tail_mass",
    "p_max",
    "trace_c2",
    "ess_tail",
    "n_tail",
    "tail_max",
    "head_mass",
)


@dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_strings: tuple[str, ...] = ()
    oracle: bool = True
    certificate: bool = True
    context_window: int = 32  # window of the question-agnostic scorer (last context tokens)
    pool_kernel: int = 5
    tight_radius: bool = True  # tr(C^2) for the tight radius (the costliest certificate statistic; README)
    tight_radius_every: int = 1  # tr(C^2) at every k-th decode step; between, its ratio to V_hat^2 is carried
    one_batch: bool = True
    drop_finished: bool = True
    stats_after_forward: bool = False  # per-step statistics of all layers at once after the forward (fewer kernels)
    keys_transposed: bool = False  # compressed keys stored (d, slots): q K^T is a plain GEMM, ~1.7x faster on CPU
    fused_attention: bool = False  # one compiled kernel per layer and step (CPU; needs the two switches above)
    packed_weights: bool = False  # linear layers through MKL's packed GEMM (CPU; a packed copy of the weights)

    def __post_init__(self) -> None:
        if self.fused_attention and not (self.stats_after_forward and self.keys_transposed):
            raise ValueError(
                "fused_attention=True needs stats_after_forward=True and keys_transposed=True "
                "(decode.stats_after_forward=true decode.keys_transposed=true)"
            )
        if not isinstance(self.tight_radius_every, int) or self.tight_radius_every < 1:
            raise ValueError(f"tight_radius_every={self.tight_radius_every!r} must be an integer >= 1")


@dataclass(kw_only=True)
class VariantResult:
    policy: Policy
    tokens: list[int]  # generated tokens, answer first (up to the one that ended the answer when rows are dropped)
    logprobs: list[float]  # log-probability of each generated token under the variant
    n_answer: int  # tokens before EOS / stop string
    answer: str
    kept_tokens: float
    stats: dict[str, np.ndarray]  # name -> (n_answer, layers, query heads), float32; missing when not computed
    compressed_layers: tuple[bool, ...] = ()  # per layer: compressed (False: a sliding window kept exactly)


class StopDetector:
    """Whether a row's answer has reached a stop string, from the text of its last few tokens only (a stop string
    of c characters spans at most 4c tokens of a byte-level vocabulary), not from the whole answer every step."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stop_strings if s)
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 4

    def __call__(self, tokens: list[int]) -> bool:
        if not self.stops or self.tokenizer is None:
            return False
        text = self.tokenizer.decode(tokens[-self.window :], skip_special_tokens=True)
        return any(s in text for s in self.stops)


def answer_length(tokenizer, tokens: list[int], eos: set[int], stops: tuple[str, ...]) -> tuple[int, str]:
    """(answer tokens before EOS or the first stop string, the answer text)."""
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


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return ids


def decode_batch(
    model,
    tokenizer,
    state: CompressedState,
    first_logits: torch.Tensor,
    start_pos: int,
    options: DecodeOptions,
    *,
    on_step: Callable[[int], None] | None = None,
) -> list[tuple[list[int], list[float], dict[str, np.ndarray], int, str]]:
    """Greedy-decode every row of `state`; per row (tokens, log-probs, statistics, n_answer, answer)."""
    bsz = first_logits.shape[0]
    dev = first_logits.device
    eos = eos_ids(model, tokenizer)
    stopped = StopDetector(tokenizer, options.stop_strings)
    logp = first_logits.float().log_softmax(-1)
    tok = logp.argmax(-1)
    tokens = [[t] for t in tok.tolist()]
    logprobs = [[x] for x in logp.gather(-1, tok[:, None])[:, 0].tolist()]
    active = list(range(bsz))  # original rows still in the batch, in batch order
    done = [False] * bsz
    steps: list[tuple[list[int], dict[str, np.ndarray]]] = []  # (rows in the batch, stats (L, B, Hq)) per step
    state.compute_certificate = options.certificate
    state.compute_trace_c2 = options.tight_radius
    state.stats_after_forward = options.stats_after_forward
    if options.fused_attention and dev.type != "cpu":
        raise ValueError(f"decode.fused_attention=true is a CPU kernel, the model runs on {dev}: set it to false")
    state.fused_attention = options.fused_attention
    for step in range(options.max_new_tokens):
        for row in active:
            done[row] = done[row] or tokens[row][-1] in eos or stopped(tokens[row])
        finished = sum(done[row] for row in active)
        if finished == len(active):
            break
        # compaction copies every buffer once: batch it (a quarter of the rows finished) rather than pay it per row
        if options.drop_finished and finished and finished >= max(1, len(active) // 4):
            keep = [i for i, row in enumerate(active) if not done[row]]
            state.keep_rows(torch.tensor(keep, device=dev))
            tok = tok[keep]
            active = [active[i] for i in keep]
        state.stats = StepStats()
        every = options.tight_radius_every
        state.trace_c2_refresh = None if every == 1 else step % every == 0
        pos = torch.full((len(active), 1), start_pos + step, device=dev, dtype=torch.long)
        logits = forward_with_state(model, tok[:, None], pos, state)
        if on_step is not None:
            on_step(step)
        steps.append((active, {k: torch.stack(v, 0).float().cpu().numpy() for k, v in vars(state.stats).items() if v}))
        if step + 1 < options.max_new_tokens:
            logp = logits.float().log_softmax(-1)
            tok = logp.argmax(-1)
            lps = logp.gather(-1, tok[:, None])[:, 0].tolist()
            for i, (row, t) in enumerate(zip(active, tok.tolist())):
                if not (options.drop_finished and done[row]):  # a finished row's answer is over
                    tokens[row].append(t)
                    logprobs[row].append(lps[i])
    state.stats = None
    out = []
    for row in range(bsz):
        n_ans, answer = answer_length(tokenizer, tokens[row], eos, options.stop_strings)
        stats: dict[str, np.ndarray] = {}
        for name in STAT_NAMES:
            if steps and name in steps[0][1]:
                per_step = [s[name][:, rows.index(row)] for rows, s in steps[:n_ans]]
                shape = steps[0][1][name].shape
                stats[name] = np.stack(per_step, 0) if per_step else np.zeros((0, shape[0], shape[2]), np.float32)
        out.append((tokens[row], logprobs[row], stats, n_ans, answer))
    return out
