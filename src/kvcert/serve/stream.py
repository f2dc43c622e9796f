"""The tokens of one generation as they are produced: `Token`, the escalation rule (`Escalation`) and its events
(`Escalated`), and `_Stream`, which turns each decode step's statistics into a token certificate, applies the rule
and calls on_token. `kvcert.serve.generate` drives it across the segments an escalation starts. `resolve_rule` turns
generate's escalate= into the rule and its threshold; the answer-level decisions taken once an answer has ended (the
draws' agreement, a RateEscalator) are `_Stream.after_answer`.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from kvcert.core import agreement as core_agreement
from kvcert.policy import FULL, Policy
from kvcert.serve.calibration import Calibration, CalibrationError
from kvcert.serve.certificate import token_certificate
from kvcert.serve.escalator import RateEscalator

if TYPE_CHECKING:
    from kvcert.hf.draws import Agreement, Draws

SIGNALS = ("certificate", "confidence", "probe", "combined", "random", "agreement")
CALIBRATED_SIGNALS = ("certificate", "probe", "combined", "agreement")  # a calibration file can give their thresholds
SCOPES = ("token", "answer")
STUDY4 = "study4"  # generate(escalate=STUDY4): STUDY4_ESCALATION where a calibration gives its threshold, else none
AUTO = "auto"  # the old default's name for STUDY4: still accepted, with a warning (study 5 dropped the default)
AUTO_RENAMED = (
    "escalate='auto' is now escalate='study4' (study 4's certificate rule) and no longer the default: study 5 found "
    "no per-answer trigger that beats confidence inside one kind of prompt; pass escalate='study4' to keep it"
)
NEEDS_DRAWS = "{what} needs several draws of the policy: pass draws=2 (or a kvcert.hf.draws.Draws) to generate"


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
    with scope="answer") or "agreement" (answer scope only, with generate's draws=: the draws' disagreement about
    the whole answer above `threshold`, judged once the answer has ended). For "certificate", "probe", "combined"
    and "agreement" a None threshold takes the calibration's for `rate`. on_untrusted: also escalate at an
    untrusted token. budget: the budget to escalate to (1.0: the full cache, whose tokens are then exact).
    scope: "token" re-reads the prompt and the tokens so far at the larger budget, drops the token that crossed the
    threshold and goes on (the tokens before it stay). "answer" treats the answer as one unit: as soon as the
    answer's running signal (its largest token certificate so far, or its lowest log-probability so far) crosses the
    threshold, everything written is discarded and the answer restarts from the prompt at the larger budget, so the
    final answer is what that budget decodes on its own (with the full cache: full-cache greedy). The calibration's
    thresholds are quantiles of exactly this answer-level score, so `rate` is the share of answers restarted.

    The defaults, `Escalation()` (answer scope, the certificate, rate 0.2, to the full cache), are study 4's winner
    (`STUDY4_ESCALATION`, `generate(escalate="study4")`). `generate` escalates only when asked: study 5 found no
    per-answer signal that beats confidence inside one kind of prompt (docs/generate.md)."""

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
        if self.signal == "agreement" and self.scope != "answer":
            raise ValueError(
                "escalation signal 'agreement' needs scope='answer': the draws' disagreement is a score of the whole "
                "answer, known once it has ended, so it cannot act at a token"
            )


# study 4's winner (preregistration/study4/PLAN.md section 7: P1 supported on both packaged models): restart the
# answer with the full cache when its largest certificate so far crosses the calibration's 20%-rate threshold. It was
# generate's default until study 5 (PLAN.md section 7: P1 and P3 not supported on both models) dropped the default:
# it wins between kinds of prompt, not inside one (results/study4/exploratory_addendum.md). Explicit now.
STUDY4_ESCALATION = Escalation(scope="answer", signal="certificate", rate=0.2, budget=1.0)
DEFAULT_ESCALATION = STUDY4_ESCALATION  # the old name, kept importable


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
        self.lead = 0  # the batch row of draw 0, the answer (draws= puts several rows in one batch)
        self.results: list = []  # the last segment's VariantResults, in policy order (draw 0 first)
        self.reading: dict | None = None  # a RateEscalator's reading of this answer (after_answer)

    def emit(self, token_id: int, logprob: float, cert: float, layers: list[float], exact: bool, budget: float):
        trusted = exact or (self.cal is not None and math.isfinite(cert))
        text = self.tokenizer.decode([token_id], skip_special_tokens=True) if self.tokenizer is not None else ""
        tok = Token(len(self.steps), token_id, text, logprob, cert, trusted, layers, budget)
        self.steps.append(tok)
        if self.on_token is not None:
            self.on_token(tok)

    def certificate(self, stats: dict[str, torch.Tensor]) -> tuple[float, list[float]]:
        """The first row's token certificate and per-layer values (one copy to the host)."""
        row = {k: stats[k][:, self.lead] for k in ("variance", "trace_c2", "out_norm")}
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

    def after_answer(
        self, policy: Policy, agreement: Agreement | None, n_answer: int, escalator: RateEscalator | None
    ) -> str | None:
        """Answer scope, once the answer has ended: the reason to restart it (the draws' disagreement above the
        threshold, or the rate escalator's decision on the answer's signal), or None. The escalator is asked once
        per answer it could restart; its reading is kept in `reading`."""
        if not (self.answer_scope and self.can_escalate(policy)):
            return None
        if escalator is not None:
            exact = policy.is_full or policy.compress_after == "prompt"
            value = answer_signal(escalator.signal, self.steps, agreement, n_answer, first_exact=exact)
            self.threshold = escalator.threshold  # read before the decision records the signal
            up = escalator.decide(value)
            self.reading = dict(value=value, threshold=self.threshold, escalated=up)
            if up:
                return f"the rate escalator's {escalator.signal} {value:.3g} > threshold {self.threshold:.3g}"
        elif self.escalate.signal == "agreement" and agreement is not None and agreement.disagreement > self.threshold:
            return f"the draws' disagreement {agreement.disagreement:.3g} > threshold {self.threshold:.3g}"
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

    def segment(self, batch, opts, policy: Policy, follow: dict[int, int] | None = None) -> tuple[int, str] | None:
        """Decode one compressed batch (policy 0 is the answer; follow: the rows fed its tokens, kvcert.hf.draws);
        (position in the segment, reason) of the token that asks for an escalation (not kept), or None when the
        answer ended. The results of every row are kept in `results`."""
        self.lead = batch.rows.index(0)  # rows are bucketed by width: draw 0 need not be the batch's first row
        logp = batch.first_logits[self.lead].float().log_softmax(-1)
        first = int(logp.argmax())
        exact = policy.is_full or policy.compress_after == "prompt"  # read exactly, then compressed
        esc = self.escalate
        probing = esc is not None and esc.signal == "probe" and self.can_escalate(policy)  # known before any token
        if probing and math.isfinite(self.probe_error) and self.probe_error > self.threshold:
            return 0, f"probe error {self.probe_error:.3g} > threshold {self.threshold:.3g}"
        # the first token counts for the answer's combined score (as calibrated), and for its confidence only when
        # the cache could change it: read exactly with the prompt, its log-probability is the same at every budget
        counts = esc is not None and (esc.signal == "combined" or (esc.signal == "confidence" and not exact))
        if self.answer_scope and counts:
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
            why = self.should_escalate(policy, cert, float(logprobs[self.lead]), trusted)
            if why is not None:
                trigger.append((step + 1, why))
                return True
            self.emit(tokens[self.lead], float(logprobs[self.lead]), cert, layers, policy.is_full, policy.budget)
            return False

        self.results = batch.decode(opts, self.tokenizer, watch=watch, follow=follow)
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


def answer_signal(
    signal: str, steps: list[Token], agreement: Agreement | None, n_answer: int, *, first_exact: bool
) -> float:
    """The answer's score for a RateEscalator (larger: escalate sooner): its largest finite certificate, the draws'
    disagreement, or its confidence (`answer_confidence`); NaN when it has none."""
    if signal == "agreement":
        return agreement.disagreement if agreement is not None else math.nan
    if signal == "confidence":
        return answer_confidence([t.logprob for t in steps], n_answer, first_exact=first_exact)
    finite = [t.certificate for t in steps if math.isfinite(t.certificate)]
    return max(finite) if finite else math.nan


def answer_confidence(logprobs: list[float], n_answer: int, *, first_exact: bool) -> float:
    """Minus the answer's lowest log-probability over its cache-dependent tokens (kvcert.core.agreement): the answer
    and the token that ended it, without the first token when it was read exactly with the prompt."""
    span = core_agreement.scored_span(n_answer, len(logprobs), first_from_prefill=first_exact)
    return core_agreement.confidence(logprobs, span)


def resolve_rule(
    escalate, cal: Calibration | None, policy: Policy, draws: Draws | None
) -> tuple[Escalation | None, float | None, RateEscalator | None]:
    """(the rule the stream applies, its threshold, the RateEscalator asked after each answer). escalate="study4"
    (or the old "auto", with a warning) -> STUDY4_ESCALATION where it can act (a compressing policy below its budget
    and a calibration with its threshold), else None; an Escalation or None as given (its threshold from the
    calibration when None); a RateEscalator decides after the answer, so its rule never fires in the stream."""
    if isinstance(escalate, RateEscalator):
        if escalate.signal == "agreement" and draws is None:
            raise ValueError(NEEDS_DRAWS.format(what="RateEscalator(signal='agreement')"))
        return Escalation(signal=escalate.signal, threshold=math.inf), math.inf, escalate
    if isinstance(escalate, str):
        if escalate == AUTO:
            warnings.warn(AUTO_RENAMED, FutureWarning, stacklevel=3)
        elif escalate != STUDY4:
            raise ValueError(f"escalate={escalate!r}: pass None, 'study4', an Escalation or a RateEscalator")
        if policy.is_full or cal is None or policy.budget >= STUDY4_ESCALATION.budget:
            return None, None, None
        try:
            cal.signal_threshold(STUDY4_ESCALATION.signal, STUDY4_ESCALATION.rate, budget=policy.budget)
        except CalibrationError:  # an older calibration file without escalation thresholds
            return None, None, None
        escalate = STUDY4_ESCALATION
    if escalate is None:
        return None, None, None
    if not isinstance(escalate, Escalation):
        raise ValueError(
            f"escalate= takes None, 'study4', an Escalation or a RateEscalator, got {type(escalate).__name__}"
        )
    threshold = escalate.threshold
    if escalate.signal == "agreement" and draws is None:
        raise ValueError(NEEDS_DRAWS.format(what="Escalation(signal='agreement')"))
    if threshold is None and escalate.signal == "agreement":
        threshold = _agreement_threshold(cal, escalate.rate, policy.budget, draws)
    elif threshold is None and cal is not None and escalate.signal in CALIBRATED_SIGNALS:
        threshold = cal.signal_threshold(escalate.signal, escalate.rate, budget=policy.budget)
    if escalate.signal == "combined" and (cal is None or "combined" not in cal.models):
        raise CalibrationError(
            "the combined signal needs a calibration file with a combined model: rerun `kvcert calibrate`"
        )
    if threshold is None and not escalate.on_untrusted:
        raise CalibrationError(
            "escalate= needs a threshold: pass Escalation(threshold=...) or a calibration for this model"
        )
    return escalate, threshold, None


def _agreement_threshold(cal: Calibration | None, rate: float, budget: float, draws: Draws) -> float:
    """The calibration's disagreement threshold for `rate` at `budget`, fitted with the same draws as the request."""
    fix = (
        "pass Escalation(signal='agreement', threshold=...) or a calibration fitted with these draws (`kvcert "
        f"calibrate --draws {draws.count} --draws-variant {draws.variant}`)"
    )
    if cal is None or "agreement" not in cal.signal_thresholds:
        what = "there is no calibration" if cal is None else "the calibration has no agreement thresholds"
        raise CalibrationError(f"the agreement signal needs a threshold and {what}: {fix}")
    why = cal.draws_mismatch(draws)
    if why is not None:
        raise CalibrationError(f"the calibration's agreement thresholds do not apply: {why}; {fix}")
    return cal.signal_threshold("agreement", rate, budget=budget)


def reference_thresholds(
    cal: Calibration | None, policy: Policy, draws: Draws | None, rate: float
) -> tuple[float | None, float | None]:
    """The calibration's thresholds for an escalation rate `rate` at the policy's budget, which the summary reads
    the answer against: the largest certificate's and (with draws the file was fitted with) the draws'
    disagreement's; None where the file has none."""
    if cal is None or policy.is_full:
        return None, None
    try:
        cert = cal.threshold(rate, policy.budget)
    except CalibrationError:
        cert = None
    agree = None
    if draws is not None:
        try:
            agree = _agreement_threshold(cal, rate, policy.budget, draws)
        except CalibrationError:
            agree = None
    return cert, agree
