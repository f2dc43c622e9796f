"""The tokens of one generation as they are produced: `Token`, the escalation rule (`Escalation`) and its events
(`Escalated`), and `_Stream`, which turns each decode step's statistics into a token certificate, applies the rule
and calls on_token. `kvcert.serve.generate` drives it across the segments an escalation starts.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch

from kvcert.policy import FULL, Policy
from kvcert.serve.certificate import token_certificate

SIGNALS = ("certificate", "confidence", "probe", "combined", "random")
CALIBRATED_SIGNALS = ("certificate", "probe", "combined")  # a calibration file can give their thresholds
SCOPES = ("token", "answer")
AUTO = "auto"  # generate(escalate=AUTO): DEFAULT_ESCALATION where a calibration gives its threshold, else none


@dataclass(frozen=True)
class Escalation:
    """When to escalate to a larger budget, and what an escalation redoes.

    signal: what triggers it: "certificate" (a token's certificate above `threshold`; None takes the calibration's
    threshold for `rate`, the share of answers the calibration data escalated), "confidence" (a token's negative
    log-probability above `threshold`: the model's own uncertainty, the baseline the certificate must beat) or
    "probe" (the prefill probe's error above `threshold`, known before the first token: kvcert.serve.probe),
    "combined" (the calibration's logistic model of a cache-induced failure over the answer's largest certificate
    so far, its lowest log-probability so far and the probe error, above `threshold` as a probability) or
    "random" (with probability `threshold`, seeded by generate's seed: the control; per token, or once per answer
    with scope="answer"). For "certificate", "probe" and "combined" a None threshold takes the calibration's for
    `rate`. on_untrusted: also escalate at an untrusted token. budget: the budget to escalate to (1.0:
    the full cache, whose tokens are then exact).
    scope: "token" re-reads the prompt and the tokens so far at the larger budget, drops the token that crossed the
    threshold and goes on (the tokens before it stay). "answer" treats the answer as one unit: as soon as the
    answer's running signal (its largest token certificate so far, or its lowest log-probability so far) crosses the
    threshold, everything written is discarded and the answer restarts from the prompt at the larger budget, so the
    final answer is what that budget decodes on its own (with the full cache: full-cache greedy). The calibration's
    thresholds are quantiles of exactly this answer-level score, so `rate` is the share of answers restarted.

    The defaults, `Escalation()` (answer scope, the certificate, rate 0.2, to the full cache), are study 4's winner
    and `generate`'s default escalation (docs/generate.md: what it was shown to do, and what it was not)."""

    signal: str = "certificate"
    threshold: float | None = None
    rate: float = 0.2
    budget: float = 1.0
    on_untrusted: bool = False
    max_escalations: int = 1
    scope: str = "answer"

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"escalation scope {self.scope!r}: choose one of {', '.join(SCOPES)}")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"escalation budget must be in (0, 1], got {self.budget!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"escalation signal {self.signal!r}: choose one of {', '.join(SIGNALS)}")
        if self.signal not in CALIBRATED_SIGNALS and self.threshold is None:
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
    """One escalation. With scope="answer" it is also passed to on_token when it happens (a restart: the tokens
    streamed so far are void and the answer streams again from its first token)."""

    token: int  # index of the first token produced after the re-read (0: the answer restarted)
    reason: str
    budget_from: float
    budget_to: float
    reread_tokens: int  # prompt + generated tokens read again (the extra prefill)
    scope: str = "token"
    discarded: int = 0  # tokens written before the escalation and thrown away (a restart discards the answer)
    threshold: float | None = None  # the rule's threshold it crossed (its signal's unit; the HTML legend's scale)


class _Stream:
    """The tokens of one generation as they are produced, across the segments an escalation starts: each token's
    certificate from its step's statistics, the escalation rule, and on_token."""

    def __init__(self, tokenizer, cal, reduction, escalate, threshold, on_token, n_layers: int, seed: int = 0):
        self.answer_scope = escalate is not None and escalate.scope == "answer"
        self.probe_error = math.nan  # the prefill probe of the current segment's cache (set by generate)
        self.combined = cal.combined_risk if cal is not None and escalate is not None else None
        self.worst_cert, self.worst_logprob = 0.0, 0.0  # the answer's running signals
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
        if math.isfinite(cert):
            self.worst_cert = max(self.worst_cert, cert)
        self.worst_logprob = min(self.worst_logprob, logprob)
        if not self.can_escalate(policy):
            return None
        if esc.signal == "combined" and self.combined is not None:
            risk = self.combined(self.worst_cert, self.worst_logprob, self.probe_error, policy.budget)
            if risk is not None and risk > self.threshold:
                return f"combined risk {risk:.3g} > threshold {self.threshold:.3g}"
        # answer scope: the answer's running max of certificates / min of log-probabilities crosses at the first
        # token that crosses, so the test per token is the same; what differs is the action (a restart)
        kind = "the answer's largest certificate" if self.answer_scope else "certificate"
        if esc.signal == "certificate" and self.threshold is not None and cert > self.threshold:
            return f"{kind} {cert:.3g} > threshold {self.threshold:.3g}"
        if esc.signal == "confidence" and -logprob > self.threshold:
            return f"log-probability {logprob:.3g} < {-self.threshold:.3g}"
        if esc.signal == "random" and not self.answer_scope and self.rng.random() < self.threshold:
            return f"random (probability {self.threshold:g} per token)"
        if esc.on_untrusted and not trusted:
            return "untrusted token"
        return None

    def can_escalate(self, policy: Policy) -> bool:
        esc = self.escalate
        return esc is not None and len(self.escalations) < esc.max_escalations and policy.budget < esc.budget

    def random_restart(self, policy: Policy) -> str | None:
        """Answer scope, random signal: one draw per answer, before it is decoded (the control at a matched rate)."""
        esc = self.escalate
        draw = self.answer_scope and esc.signal == "random" and self.can_escalate(policy)
        if draw and self.rng.random() < self.threshold:
            return f"random (probability {self.threshold:g} per answer)"
        return None

    def segment(self, batch, opts, policy: Policy) -> tuple[int, str] | None:
        """Decode one compressed batch; (position in the segment, reason) of the token that asks for an escalation
        (not kept), or None when the answer ended."""
        logp = batch.first_logits[0].float().log_softmax(-1)
        first = int(logp.argmax())
        exact = policy.is_full or policy.compress_after == "prompt"  # read exactly, then compressed
        esc = self.escalate
        probing = esc is not None and esc.signal == "probe" and self.can_escalate(policy)  # known before any token
        if probing and math.isfinite(self.probe_error) and self.probe_error > self.threshold:
            return 0, f"probe error {self.probe_error:.3g} > threshold {self.threshold:.3g}"
        if self.answer_scope and esc.signal in ("confidence", "combined"):  # the first token counts for the answer
            why = self.should_escalate(policy, 0.0, float(logp[first]), True)
            if why is not None:
                return 0, why
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


def _escalate_to(stream: _Stream, escalate: Escalation, current: Policy, why: str, *, kept: int, reread: int) -> Policy:
    """Record an escalation from `current` (the tokens from `kept` on are dropped) and return the policy to go on
    with; a restart (answer scope) is announced to on_token."""
    to = FULL if escalate.budget >= 1.0 else Policy(**{**asdict(current), "budget": escalate.budget})
    event = Escalated(
        token=kept,
        reason=why,
        budget_from=current.budget,
        budget_to=to.budget,
        reread_tokens=reread,
        scope=escalate.scope,
        discarded=len(stream.steps) - kept,
        threshold=stream.threshold,
    )
    del stream.steps[kept:]
    stream.escalations.append(event)
    if stream.answer_scope:  # the restarted answer's running signals start afresh
        stream.worst_cert, stream.worst_logprob = 0.0, 0.0
    if stream.answer_scope and stream.on_token is not None:
        stream.on_token(event)
    return to
