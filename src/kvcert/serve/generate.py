"""Certified generation for one prompt: `generate` reads the prompt once, keeps a compressed cache (serving mode:
the full cache never exists), decodes greedily and gives every token a calibrated certificate; with `escalate=` it
re-reads the prompt and the tokens so far at a larger budget (or the full cache) when a token's certificate crosses
a threshold, and goes on from there.

    from kvcert import generate, load_model
    model, tokenizer = load_model("smollm2-135m-instruct")
    out = generate(model, tokenizer, context=document, question="Who wrote it?", budget=0.25)
    print(out.text, out.summary())

Token i's certificate is that of the forward that predicted it (`kvcert.serve.certificate`). The first token after
a prompt is read comes from exact attention over the whole prompt (the policy compresses after reading it), so its
certificate is 0; so is every token decoded with the full cache. A token is `trusted` when a calibration applies to
the model, the policy and the budget and its certificate is finite; without one, `generate` warns once and marks
every token untrusted: an uncalibrated radius is never presented as a bound.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvcert.policy import FULL, Policy
from kvcert.serve.calibration import Calibration, CalibrationError, shipped
from kvcert.serve.certificate import token_certificate

DEFAULT_MAX_NEW_TOKENS = 64
SIGNALS = ("certificate", "confidence", "random")
MESSAGES_WINDOW = 32  # tokens at the end of a chat prompt that play the question (see build_prompt)
_WARNED: set[tuple] = set()


def default_policy(budget: float) -> Policy:
    """The studies' randomized policy: question-aware window scorer, tail fraction 0.75, floor 0.2."""
    return Policy(scorer="window_question", design="randomized", budget=budget, tail_fraction=0.75, floor=0.2)


@dataclass(frozen=True)
class Escalation:
    """When to re-read the prompt and the tokens so far at a larger budget.

    signal: what triggers it: "certificate" (a token's certificate above `threshold`; None takes the calibration's
    threshold for `rate`, the share of answers the calibration data escalated), "confidence" (a token's negative
    log-probability above `threshold`: the model's own uncertainty, the baseline the certificate must beat) or
    "random" (each token with probability `threshold`, seeded by generate's seed: the control). on_untrusted: also
    escalate at an untrusted token. budget: the budget to escalate to (1.0: the full cache, whose tokens are then
    exact)."""

    signal: str = "certificate"
    threshold: float | None = None
    rate: float = 0.1
    budget: float = 1.0
    on_untrusted: bool = False
    max_escalations: int = 1

    def __post_init__(self):
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"escalation budget must be in (0, 1], got {self.budget!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"escalation signal {self.signal!r}: choose one of {', '.join(SIGNALS)}")
        if self.signal != "certificate" and self.threshold is None:
            raise ValueError(f"escalation signal {self.signal!r} needs a threshold")


@dataclass
class Token:
    index: int
    id: int
    text: str
    logprob: float
    certificate: float  # calibrated relative radius (kvcert.serve.certificate); 0 for tokens read exactly
    trusted: bool
    layers: list[float]  # per layer, the largest head's value (NaN on layers kept exactly or never compressed)
    budget: float  # the budget of the cache that produced it


@dataclass
class Escalated:
    token: int  # index of the first token produced after the re-read
    reason: str
    budget_from: float
    budget_to: float
    reread_tokens: int  # prompt + generated tokens read again (the extra prefill)


@dataclass
class Generation:
    text: str
    steps: list[Token]
    escalations: list[Escalated]
    kv_bytes: int  # the most the compressed cache held (keys and values, reserved slots included)
    full_kv_bytes: int  # what the full cache of the same tokens holds (same dtype, same layers)
    prompt_tokens: int
    policy: Policy
    calibration: str | None  # what calibrated the certificates ("model: file"), None when uncalibrated
    reduction: str
    stopped: str  # "eos", "stop string", "max_new_tokens"

    @property
    def tokens(self) -> list[int]:
        return [t.id for t in self.steps]

    @property
    def logprobs(self) -> list[float]:
        return [t.logprob for t in self.steps]

    @property
    def certificate(self) -> list[float]:
        return [t.certificate for t in self.steps]

    @property
    def trusted(self) -> list[bool]:
        return [t.trusted for t in self.steps]

    def summary(self) -> str:
        """One line: the certificate over the answer, trust, escalations and memory."""
        certs = [c for c in self.certificate if math.isfinite(c)]
        worst = f"{max(certs):.3f}" if certs else "n/a"
        trust = f"{sum(self.trusted)}/{len(self.steps)} tokens trusted"
        if self.calibration is None:
            trust += " (uncalibrated)"
        esc = f"{len(self.escalations)} escalation(s)" + (
            f" (at token {', '.join(str(e.token) for e in self.escalations)})" if self.escalations else ""
        )
        mem = f"KV {self.kv_bytes / 2**20:.1f} MiB vs full {self.full_kv_bytes / 2**20:.1f} MiB"
        return (
            f"certificate max {worst} ({self.reduction}, relative radius at 0.95), {trust}, {esc}, {mem} "
            f"[{self.policy.scorer} x {self.policy.design} @ {self.policy.budget:g}]"
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out["policy"] = asdict(self.policy)
        out["summary"] = self.summary()
        return out


def _warn_once(key: tuple, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def resolve_calibration(
    calibration, model_name: str | None, n_layers: int, policy: Policy
) -> tuple[Calibration | None, str | None]:
    """(the calibration to use or None, its label). "auto": the shipped file of a packaged model; a path or a
    Calibration must match the model, the policy and the budget (CalibrationError otherwise)."""
    label = None
    if calibration == "auto":
        cal = shipped(model_name) if model_name else None
        if cal is not None:
            label = f"{model_name}: shipped"
            if cal.mismatch(model_name, n_layers, policy, policy.budget) is not None:
                cal = None
    elif calibration is None:
        cal = None
    else:
        if isinstance(calibration, Calibration):
            cal, label = calibration, f"{calibration.model}: given"
        else:
            cal, label = Calibration.load(calibration), f"{Path(calibration).name}"
        why = cal.mismatch(model_name, n_layers, policy, policy.budget)
        if why is not None:
            raise CalibrationError(
                f"calibration {label} does not apply: {why}; run `kvcert calibrate` for this model and policy"
            )
    if cal is None:
        _warn_once(
            (model_name, policy),
            f"kvcert: no calibration for model {model_name or '(unnamed)'} with {policy.label}: every token is "
            "marked untrusted (run `kvcert calibrate` to fit one)",
        )
        return None, None
    return cal, label


def build_prompt(tokenizer, *, context, question, messages, prompt_format: str):
    """(input ids, index where the question starts, stop strings)."""
    from kvcert.tasks import Example, render
    from kvcert.tasks.render import end_of_turn_strings

    if messages is not None:
        if context is not None or question is not None:
            raise ValueError("pass either messages= or context= and question=, not both")
        if not messages or not isinstance(messages[-1], dict) or "content" not in messages[-1]:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # a conversation has no context / question split: the last MESSAGES_WINDOW tokens (the end of the last turn
        # and the generation prompt) play the question, the observation window SnapKV-style scorers read
        return ids, max(1, len(ids) - MESSAGES_WINDOW), end_of_turn_strings(tokenizer)
    if context is None or question is None:
        raise ValueError("pass context= and question= (or messages=)")
    example = Example(
        id="prompt",
        task="user",
        context=context,
        question=question,
        answers=(),
        depth=math.nan,
        metric="em",
        target_tokens=0,
    )
    rendered = render(example, tokenizer, prompt_format)
    return rendered.input_ids, rendered.question_start, rendered.stop_strings


def full_cache_bytes(model, tokens: int) -> int:
    """Bytes of the full cache of `tokens` tokens: keys and values of every layer (a sliding-window layer holds at
    most its window), in the model's dtype."""
    from kvcert.hf.attention import layer_windows

    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = next(model.parameters()).element_size()
    held = sum(tokens if w is None else min(w, tokens) for w in layer_windows(model))
    return 2 * n_kv * head_dim * size * held


def kv_bytes(batch) -> int:
    """Bytes of the keys and values a CompressedBatch holds: every bucket and layer, padding and the slots reserved
    for the tokens still to come included."""
    return sum(
        buf.keys.numel() * buf.keys.element_size() + buf.values.numel() * buf.values.element_size()
        for bucket in batch.state.buckets
        for buf in bucket.layers
    )


class _Stream:
    """The tokens of one generation as they are produced, across the segments an escalation starts: each token's
    certificate from its step's statistics, the escalation rule, and on_token."""

    def __init__(self, tokenizer, cal, reduction, escalate, threshold, on_token, n_layers: int, seed: int = 0):
        self.tokenizer, self.cal, self.reduction = tokenizer, cal, reduction
        self.escalate, self.threshold, self.on_token = escalate, threshold, on_token
        self.multipliers = cal.multiplier_tensor() if cal is not None else None
        self.no_layers = [math.nan] * n_layers
        self.steps: list[Token] = []
        self.escalations: list[Escalated] = []
        self.rng = random.Random(f"kvcert-escalate-{seed}")

    def emit(self, token_id: int, logprob: float, cert: float, layers: list[float], exact: bool, budget: float):
        trusted = exact or (self.cal is not None and math.isfinite(cert))
        text = self.tokenizer.decode([token_id], skip_special_tokens=True) if self.tokenizer is not None else ""
        tok = Token(len(self.steps), token_id, text, logprob, cert, trusted, layers, budget)
        self.steps.append(tok)
        if self.on_token is not None:
            self.on_token(tok)

    def certificate(self, stats: dict[str, torch.Tensor]) -> tuple[float, list[float]]:
        """The first row's token certificate and per-layer values (one copy to the host)."""
        row = {k: stats[k][:, 0] for k in ("variance", "trace_c2", "out_norm")}
        if self.multipliers is not None:
            self.multipliers = self.multipliers.to(row["variance"].device)
        value, per_layer = token_certificate(row, self.multipliers, self.reduction)
        host = torch.cat([value[None], per_layer]).tolist()
        return host[0], host[1:]

    def should_escalate(self, policy: Policy, cert: float, logprob: float, trusted: bool) -> str | None:
        esc = self.escalate
        if esc is None or len(self.escalations) >= esc.max_escalations or policy.budget >= esc.budget:
            return None
        if esc.signal == "certificate" and self.threshold is not None and cert > self.threshold:
            return f"certificate {cert:.3g} > threshold {self.threshold:.3g}"
        if esc.signal == "confidence" and -logprob > self.threshold:
            return f"log-probability {logprob:.3g} < {-self.threshold:.3g}"
        if esc.signal == "random" and self.rng.random() < self.threshold:
            return f"random (probability {self.threshold:g} per token)"
        if esc.on_untrusted and not trusted:
            return "untrusted token"
        return None

    def segment(self, batch, opts, policy: Policy) -> tuple[int, str] | None:
        """Decode one compressed batch; (position in the segment, reason) of the token that asks for an escalation
        (not kept), or None when the answer ended."""
        logp = batch.first_logits[0].float().log_softmax(-1)
        first = int(logp.argmax())
        exact = policy.is_full or policy.compress_after == "prompt"  # read exactly, then compressed
        self.emit(first, float(logp[first]), 0.0 if exact else math.nan, self.no_layers, exact, policy.budget)
        trigger: list[tuple[int, str]] = []

        def watch(step: int, tokens: list[int], logprobs: list[float], stats: dict[str, torch.Tensor]) -> bool:
            if policy.is_full or "variance" not in stats:
                cert, layers = 0.0, self.no_layers
            else:
                cert, layers = self.certificate(stats)
            trusted = policy.is_full or (self.cal is not None and math.isfinite(cert))
            why = self.should_escalate(policy, cert, float(logprobs[0]), trusted)
            if why is not None:
                trigger.append((step + 1, why))
                return True
            self.emit(tokens[0], float(logprobs[0]), cert, layers, policy.is_full, policy.budget)
            return False

        batch.decode(opts, self.tokenizer, watch=watch)
        return trigger[0] if trigger else None


@torch.no_grad()
def generate(
    model,
    tokenizer,
    *,
    context: str | None = None,
    question: str | None = None,
    messages: list[dict] | None = None,
    budget: float = 0.25,
    policy: Policy | None = None,
    calibration="auto",
    escalate: Escalation | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    on_token: Callable[[Token], None] | None = None,
    prompt_format: str | None = None,
    model_name: str | None = None,
    seed: int = 0,
) -> Generation:
    """Greedy generation from a compressed cache with a per-token certificate (see the module docstring).

    policy: default the studies' randomized policy at `budget` (`default_policy`); calibration: "auto" (the shipped
    file of a packaged model), a path, a Calibration, or None; escalate: an Escalation or None; on_token(token) is
    called for each token as it is produced (streaming); prompt_format: chat / plain / auto (default: the packaged
    model's, else auto); seed: the design's random draws."""
    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading
    from kvcert.hf.decode import answer_length, eos_ids

    model_name = model_name or getattr(model, "kvcert_name", None)
    policy = policy or default_policy(budget)
    if prompt_format is None:
        prompt_format = "auto"
        if model_name:
            from kvcert.hf.loading import EMBEDDED_MODELS, embedded_prompt_format

            if model_name in EMBEDDED_MODELS:
                prompt_format = embedded_prompt_format(model_name)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids, qs, stops = build_prompt(
        tokenizer, context=context, question=question, messages=messages, prompt_format=prompt_format
    )
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and len(ids) + max_new_tokens > window:
        raise ValueError(
            f"the prompt has {len(ids)} tokens and {max_new_tokens} new tokens would end past the model's window of "
            f"{window}: shorten the context or lower max_new_tokens"
        )
    n_layers = int(model.config.num_hidden_layers)
    cal, cal_label = resolve_calibration(calibration, model_name, n_layers, policy)
    reduction = cal.reduction if cal is not None else "max"
    threshold = None
    if escalate is not None:
        threshold = escalate.threshold
        if threshold is None and cal is not None and escalate.signal == "certificate":
            threshold = cal.threshold(escalate.rate)
        if threshold is None and not escalate.on_untrusted:
            raise CalibrationError(
                "escalate= needs a threshold: pass Escalation(threshold=...) or a calibration for this model"
            )
    stream = _Stream(tokenizer, cal, reduction, escalate, threshold, on_token, n_layers, seed)
    current, kv_held, stopped = policy, 0, "max_new_tokens"
    while True:
        generated = [t.id for t in stream.steps]
        opts = DecodeOptions(
            max_new_tokens=max_new_tokens - len(generated),
            stop_strings=tuple(stops),
            oracle=False,
            certificate=not current.is_full,
        )
        prompt = Prompt(input_ids=ids + generated, question_start=qs, example_id=f"kvcert-generate-{seed}")
        batch = compress_while_reading(model, prompt, [current], opts)
        kv_held = max(kv_held, kv_bytes(batch))
        trigger = stream.segment(batch, opts, current)
        if trigger is None:
            break
        at, why = trigger
        kept = len(generated) + at
        to = FULL if escalate.budget >= 1.0 else Policy(**{**asdict(current), "budget": escalate.budget})
        del stream.steps[kept:]
        stream.escalations.append(
            Escalated(
                token=kept, reason=why, budget_from=current.budget, budget_to=to.budget, reread_tokens=len(ids) + kept
            )
        )
        current = to
    all_tokens = [t.id for t in stream.steps]
    eos = eos_ids(model, tokenizer)
    n_answer, text = answer_length(tokenizer, all_tokens, eos, tuple(stops))
    if n_answer < len(all_tokens):
        stopped = "eos" if all_tokens[n_answer] in eos else "stop string"
    del stream.steps[n_answer:]
    return Generation(
        text=text,
        steps=stream.steps,
        escalations=stream.escalations,
        kv_bytes=kv_held,
        full_kv_bytes=full_cache_bytes(model, len(ids) + max_new_tokens),
        prompt_tokens=len(ids),
        policy=policy,
        calibration=cal_label,
        reduction=reduction,
        stopped=stopped,
    )
