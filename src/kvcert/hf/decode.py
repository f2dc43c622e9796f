"""Greedy decoding of a batch of compressed variants, with the certificate and oracle statistics of every step.

`DecodeOptions` is the one place the decoding defaults live. Every option has a meaning for the records (what is
computed, how long answers run) except `backend`, which chooses how the single-token attention step is computed:
"auto" (the default) takes the compiled CPU kernel (`kvcert.hf.kernel`) when it builds and the cache is float32 on
the CPU, torch ops otherwise, and says which once; "torch" / "compiled" force one. Both fill the same buffers and
the statistics after the forward are one code path, so they agree to float rounding (tests/test_hf_decode.py).

A row may *follow* another (teacher forcing, kvcert.hf.draws): it is fed the leader's tokens instead of its own
greedy ones, records the log-probability its cache gives each of them, and its own greedy token at each step
(`VariantResult.own_tokens`): how a second draw of a policy reads the first draw's answer. Rows that follow no row
decode with exactly the same operations as without followers.

Finished variants leave the batch (in batches: compaction copies every buffer), so no attention, certificate or
oracle work is spent on them. The decoder waits for the device once per step (one copy of the new tokens and their
log-probabilities, for the end-of-answer checks); the statistics stay on the device until one copy at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvcert.defaults import DEFAULT_MAX_NEW_TOKENS
from kvcert.hf.attention import forward_with_state
from kvcert.hf.compressed_state import CompressedState, device_index
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


BACKENDS = ("auto", "torch", "compiled")


@dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_strings: tuple[str, ...] = ()
    oracle: bool = True
    certificate: bool = True
    context_window: int = 32  # window of the question-agnostic scorer (last context tokens)
    pool_kernel: int = 5
    tight_radius: bool = True  # tr(C^2) for the tight radius (the costliest certificate statistic)
    tight_radius_every: int = 1  # tr(C^2) at every k-th decode step; between, its ratio to V_hat^2 is carried
    backend: str = "auto"  # auto | torch | compiled: how the single-token attention step is computed

    def __post_init__(self) -> None:
        if not isinstance(self.tight_radius_every, int) or self.tight_radius_every < 1:
            raise ValueError(f"tight_radius_every={self.tight_radius_every!r} must be an integer >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; choose one of {', '.join(BACKENDS)}")


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
    own_tokens: list[int] | None = None  # a follower's own greedy token at each step (None: the row follows no row)
    follows: int | None = None  # the policy index whose tokens this row was fed (None: its own greedy tokens)


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


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's most likely next token and its log-probability (float32 log-softmax), on the device."""
    logp = logits.float().log_softmax(-1)
    tok = logp.argmax(-1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Token ids and float32 log-probabilities in one device-to-host copy (float64 holds both exactly)."""
    both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]).tolist()
    return [int(t) for t in both[0]], both[1]


def teacher_force(
    logits: torch.Tensor, tok: torch.Tensor, picked: torch.Tensor, rows: list[int], follow: dict[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens fed, their log-probabilities, each row's own greedy token): follower rows (original row -> leader's
    original row, both in `rows`, the batch order) take their leader's token and its float32 log-probability under
    their own logits; every other row keeps its greedy token and log-probability untouched."""
    at = {row: i for i, row in enumerate(rows)}
    fol = [at[r] for r in rows if r in follow]
    if not fol:
        return tok, picked, tok
    dev = tok.device
    fol_ix, lead_ix = device_index(fol, dev), device_index([at[follow[r]] for r in rows if r in follow], dev)
    fed = tok.index_copy(0, fol_ix, tok.index_select(0, lead_ix))
    logp = logits.index_select(0, fol_ix).float().log_softmax(-1)
    picked = picked.index_copy(0, fol_ix, logp.gather(-1, fed.index_select(0, fol_ix)[:, None])[:, 0])
    return fed, picked, tok


def stats_to_host(
    steps: list[tuple[list[int], dict[str, torch.Tensor]]],
) -> list[tuple[list[int], dict[str, np.ndarray]]]:
    """Every step's statistics as float32 arrays, in one device-to-host copy at the end of the decode."""
    parts = [v.float().reshape(-1) for _, s in steps for v in s.values()]
    if not parts:
        return [(rows, {}) for rows, _ in steps]
    flat = torch.cat(parts).cpu().numpy()
    host, at = [], 0
    for rows, s in steps:
        arrays = {}
        for name, v in s.items():
            arrays[name] = flat[at : at + v.numel()].reshape(v.shape)
            at += v.numel()
        host.append((rows, arrays))
    return host


def decode_batch(
    model,
    tokenizer,
    state: CompressedState,
    first_logits: torch.Tensor,
    start_pos: int,
    options: DecodeOptions,
    *,
    on_step: Callable[[int], None] | None = None,
    watch: Callable[[int, list[int], list[float], dict[str, torch.Tensor]], bool] | None = None,
    follow: dict[int, int] | None = None,
) -> list[tuple[list[int], list[float], dict[str, np.ndarray], int, str, list[int] | None]]:
    """Greedy-decode every row of `state`; per row (tokens, log-probs, statistics, n_answer, answer, own greedy
    tokens of a follower or None). follow: row -> the row whose tokens it is fed (teacher forcing; a leader must
    follow no row).

    watch(step, new tokens and their log-probabilities for the rows in the batch, the step's statistics on the
    device (layers, rows, Hq)), when given, runs after each step that made a token (the statistics are those of the
    forward that predicted it);
    returning True ends the decode there (`kvcert.serve` streams and escalates through it)."""
    bsz = first_logits.shape[0]
    dev = first_logits.device
    eos = eos_ids(model, tokenizer)
    stopped = StopDetector(tokenizer, options.stop_strings)
    follow = dict(follow or {})
    if any(lead in follow or not 0 <= lead < bsz or lead == row for row, lead in follow.items()):
        raise ValueError(f"follow={follow}: a row follows another row of the batch that follows no row")
    active = list(range(bsz))  # original rows still in the batch, in batch order
    tok, picked = greedy(first_logits)
    tok, picked, own_tok = teacher_force(first_logits, tok, picked, active, follow)
    first_tokens, first_lps = to_host(tok, picked)
    own = {row: [t] for row, t in zip(active, to_host(own_tok, picked)[0]) if row in follow} if follow else {}
    tokens = [[t] for t in first_tokens]
    logprobs = [[x] for x in first_lps]
    done = [False] * bsz
    steps: list[tuple[list[int], dict[str, torch.Tensor]]] = []  # (rows in the batch, stats (L, B, Hq)) per step
    state.compute_certificate = options.certificate
    state.compute_trace_c2 = options.tight_radius
    for step in range(options.max_new_tokens):
        for row in active:
            done[row] = done[row] or tokens[row][-1] in eos or stopped(tokens[row])
        finished = sum(done[row] for row in active)
        if finished == len(active):
            break
        # compaction copies every buffer once: batch it (a quarter of the rows finished) rather than pay it per row
        if finished and finished >= max(1, len(active) // 4):
            keep = [i for i, row in enumerate(active) if not done[row]]
            state.keep_rows(keep)
            tok = tok.index_select(0, device_index(keep, dev))
            active = [active[i] for i in keep]
        state.recompress(step)  # policies with recompress_every: back to the budget every N steps
        state.want_stats = True
        every = options.tight_radius_every
        state.trace_c2_refresh = None if every == 1 else step % every == 0
        logits = forward_with_state(model, tok[:, None], start_pos + step, state)
        if on_step is not None:
            on_step(step)
        steps.append((active, state.stats or {}))
        if step + 1 < options.max_new_tokens:
            tok, picked = greedy(logits)
            if follow:
                tok, picked, own_tok = teacher_force(logits, tok, picked, active, follow)
                tok_own = torch.stack([tok, own_tok])
                new_tokens, lps = to_host(tok_own.reshape(-1), picked.repeat(2))  # still one sync
                own_now, new_tokens, lps = new_tokens[len(active) :], new_tokens[: len(active)], lps[: len(active)]
            else:
                new_tokens, lps = to_host(tok, picked)  # the step's one sync with the device
            for i, row in enumerate(active):
                if not done[row]:  # a finished row's answer is over
                    tokens[row].append(new_tokens[i])
                    logprobs[row].append(lps[i])
                    if row in own:
                        own[row].append(own_now[i])
            if watch is not None and watch(step, new_tokens, lps, state.stats or {}):
                break
    state.want_stats, state.stats = False, None
    host = stats_to_host(steps)
    out = []
    for row in range(bsz):
        n_ans, answer = answer_length(tokenizer, tokens[row], eos, options.stop_strings)
        stats: dict[str, np.ndarray] = {}
        for name in STAT_NAMES:
            if host and name in host[0][1]:
                per_step = [s[name][:, rows.index(row)] for rows, s in host[:n_ans]]
                shape = host[0][1][name].shape
                stats[name] = np.stack(per_step, 0) if per_step else np.zeros((0, shape[0], shape[2]), np.float32)
        out.append((tokens[row], logprobs[row], stats, n_ans, answer, own.get(row)))
    return out
