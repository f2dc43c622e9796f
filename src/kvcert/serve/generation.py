"""What `kvcert.generate` returns: `Generation`, the answer's tokens with their certificates, the escalations, the
memory held, the draws' agreement, and `summary()`: the answer first, then which cache it came from, what its numbers
mean against the calibration (the threshold for a 20% escalation rate, the rate study 4 escalated at) and what a
user can do with them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvcert.policy import Policy
from kvcert.serve.probe import BudgetChoice, Probe
from kvcert.serve.stream import Escalated, Escalation, Token

if TYPE_CHECKING:
    from kvcert.hf.draws import Agreement, Draws

EXACT = "none needed (full cache: exact)"  # Generation.calibration of a full-cache generation
REFERENCE_RATE = 0.2  # the escalation rate the summary reads the answer's numbers against (study 4's rule)
# what the draws' disagreement means: nats, the largest drop in log-probability another draw gives one answer token
DISAGREEMENT_SCALE = (
    "nats: 0 = the draws agree, 0.69 = one token half as likely under another draw, 2.3 = ten times less likely"
)


def cache_label(policy: Policy) -> str:
    """The cache a policy keeps, in words: "the full cache" or "<scorer> x <design> @ <budget>"."""
    return "the full cache" if policy.is_full else f"{policy.scorer} x {policy.design} @ {policy.budget:g}"


def policy_words(policy: Policy) -> str:
    """The policy in words, e.g. "keeps 25% of the prompt's KV: the tokens the question attends to most
    (window_question scorer), 75% of the budget drawn at random in proportion to their scores (randomized design,
    floor 0.2), draw seed 0"."""
    if policy.is_full:
        return "the full cache (every token kept: exact)"
    text = f"keeps {policy.budget:.0%} of the prompt's KV, chosen by the {policy.scorer} scorer"
    text += f" with the {policy.design} design"
    if policy.has_certificate:
        head, tail = 1 - policy.tail_fraction, policy.tail_fraction
        how = "in proportion to their scores" if policy.design == "randomized" else "by the design"
        text += f": {head:.0%} of the budget the highest-scoring tokens, {tail:.0%} drawn at random {how}"
        text += f" (floor {policy.floor:g}, score power {policy.score_power:g}, draw seed {policy.seed})"
    return text + f" [{policy.label}]"


def _budget_cache(budget: float, policy: Policy) -> str:
    return "the full cache" if budget >= 1.0 else f"{policy.scorer} x {policy.design} @ {budget:g}"


@dataclass
class Generation:
    text: str
    steps: list[Token]
    escalations: list[Escalated]
    kv_bytes: int  # the most the compressed cache held (keys and values, reserved slots included)
    full_kv_bytes: int  # what this engine's full cache of the same prompt and max_new_tokens holds (>= kv_bytes)
    prompt_tokens: int
    policy: Policy  # the policy the answer started with (after a restart the answer comes from a larger budget)
    calibration: str | None  # what calibrated the certificates ("model: file"), None when uncalibrated
    reduction: str
    stopped: str  # "eos", "stop string", "max_new_tokens"
    probe: Probe | None = None  # the prefill probe of the cache the answer started from (kvcert.serve.probe)
    budget_choice: BudgetChoice | None = None  # with tolerance=: the ladder's probe errors and the budget chosen
    answer_prefix: str = ""  # read as part of the prompt, not part of `text`
    escalation: Escalation | None = None  # the rule that applied (escalate="study4" resolved), None without one
    threshold: float | None = None  # that rule's threshold in its signal's unit (the one each Escalated names)
    draws: Draws | None = None  # the draws decoded (draws=); None: one draw (or the full cache, which needs none)
    # the draws' agreement about draw 0's answer: the answer, or after a restart the answer it discarded
    agreement: Agreement | None = None
    confidence: float = math.nan  # minus the lowest log-probability of the answer's cache-dependent tokens
    escalator: dict | None = None  # with a RateEscalator: its reading of this answer and its counts so far
    # the calibration's thresholds for a REFERENCE_RATE escalation rate at the answer's first budget (None: none
    # applies): the answer's largest certificate's, and the draws' disagreement's (with draws the file was fitted with)
    reference_threshold: float | None = None
    agreement_reference: float | None = None
    guarantee: str | None = None  # with budget= a calibrate-budget file: its guarantee in one sentence

    @property
    def answer(self) -> str:
        """The answer's text (the same as `text`)."""
        return self.text

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

    @property
    def restart(self) -> Escalated | None:
        """The answer-scope escalation the answer restarted with (what was written before it was discarded)."""
        restarts = [e for e in self.escalations if e.scope == "answer"]
        return restarts[-1] if restarts else None

    def source(self) -> str:
        """Which cache the answer came from, and why when an escalation chose it."""
        restart = self.restart
        if restart is not None:
            to = _budget_cache(restart.budget_to, self.policy)
            return f"{to} (restarted from budget {restart.budget_from:g}: {restart.reason})"
        started = cache_label(self.policy)
        if self.budget_choice is not None:
            c = self.budget_choice
            started += f" (budget chosen for tolerance {c.tolerance:g})"
        for esc in self.escalations:  # token scope: the tokens before it stay, those after come from the larger cache
            started += f", then {_budget_cache(esc.budget_to, self.policy)} from token {esc.token} ({esc.reason})"
        return started

    def summary(self) -> str:
        """A few lines: the answer; the cache it came from (and why), its largest token certificate read against the
        calibration's threshold for a 20% escalation rate, the KV held, the prefill probe and the draws'
        disagreement with its scale; then what a user can do with these numbers."""
        certs = [c for c in self.certificate if math.isfinite(c)]
        worst = max(certs) if certs else math.nan
        exact = bool(self.steps) and all(t.budget >= 1.0 for t in self.steps)
        if exact:
            cert = "certificate 0 (full cache: exact)"
        else:
            calibrated = "" if self.calibration is None else "calibrated "
            each = f"each token's {calibrated}95% relative error radius, {self.reduction} over layers"
            cert = f"largest token certificate {worst:.3f} ({each}" if certs else f"no certificate ({each}"
            cert += ", uncalibrated: not a bound)" if self.calibration is None else ")"
        ref, verdict = self.reference_threshold, None
        if not exact and ref is not None and certs:
            verdict = "above" if worst > ref else "below"
            cert += (f", {verdict} the calibration's threshold {ref:.3g} for a {REFERENCE_RATE:.0%} escalation rate "
                     f"at budget {self.policy.budget:g}")  # fmt: skip
        mem = f"KV {self.kv_bytes / 2**20:.1f} MiB of the full cache's {self.full_kv_bytes / 2**20:.1f} MiB"
        if self.escalations:
            mem += " (the most held, the re-read included)"
        line = f"answer from {self.source()}: {cert}; {mem}"
        if self.escalation is not None and not self.escalations and self.threshold is not None:
            line += f"; not escalated ({self.escalation.signal} threshold {self.threshold:.3g})"
        if self.probe is not None:
            where = "the discarded cache's " if self.restart is not None else ""
            line += f"; {where}prefill probe error {self.probe.error:.3g}"
        if self.agreement is not None and self.draws is not None:
            # after an escalation the draws speak of the answer they decoded: discarded, or cut at the escalation
            where = "the discarded answer's " if self.restart is not None else ""
            where = "before the escalation, " if self.escalations and not where else where
            line += f"; {where}{draws_phrase(self.draws, self.agreement, self.agreement_reference)}"
        if self.escalator is not None:
            n, k, rate = self.escalator["answers"], self.escalator["escalations"], self.escalator["rate"]
            share = f" ({k / n:.0%})" if n else ""
            line += f"; escalated {k} of {n} answers{share}, target {rate:.0%}"
        if self.guarantee:
            line += f"; {self.guarantee}"
        return "\n".join([f"answer: {self.text.strip()}", line, self._advice(verdict, exact)])

    def _advice(self, verdict: str | None, exact: bool) -> str:
        """What a user can do with the numbers (one line)."""
        if self.restart is not None:
            return "what you can do: nothing: the answer was redone with the full cache, so it is exact"
        if exact:
            return "what you can do: nothing: the full cache is exact (a smaller budget= holds less KV)"
        if self.calibration is None:
            return ("what you can do: the radius is uncalibrated, so read it as a relative size only; run `kvcert "
                    "calibrate` for this model and policy to get thresholds")  # fmt: skip
        rank = ("(the certificate ranks kinds of prompt the cache hurts, study 4; within one kind it is no better "
                "than the model's confidence, study 5)")  # fmt: skip
        if verdict == "above":
            redo = "redo it with the full cache (policy=FULL, `--budget 1`) or a larger budget=, or pass "
            return (
                f"what you can do: this answer is among the {REFERENCE_RATE:.0%} the calibration flags; {redo}"
                f"escalate='study4' (`--escalate study4`) to restart such answers automatically {rank}"
            )
        if verdict == "below":
            return ("what you can do: nothing flags this answer; escalate='study4' (`--escalate study4`) restarts "
                    f"the {REFERENCE_RATE:.0%} of answers above the threshold with the full cache {rank}")  # fmt: skip
        return "what you can do: compare the certificate across your prompts: larger means more error from the cache"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["policy"] = asdict(self.policy)
        out["summary"] = self.summary()
        return out


def draws_phrase(draws: Draws, agreement: Agreement, threshold: float | None = None) -> str:
    """ "draws: 2 independent, disagreement 1.23 (nats: 0 = ...), 1/1 other draw's answer differs" (split halves:
    "halves"); with the calibration's 20%-rate threshold, whether the disagreement is above or below it."""
    split = draws.variant == "split"
    n, k = len(agreement.row_differs), sum(agreement.row_differs)
    one, many = ("half", "halves") if split else ("other draw", "other draws")
    differ = f"{k}/1 {one}'s answer differs" if n == 1 else f"{k}/{n} {many}' answers differ"
    head = "split halves of one draw" if split else f"{draws.count} independent"
    value = agreement.disagreement
    against = ""
    if threshold is not None and math.isfinite(value):
        side = "above" if value > threshold else "below"
        against = f", {side} the calibration's {REFERENCE_RATE:.0%}-rate threshold {threshold:.3g}"
    return f"draws: {head}, disagreement {value:.3g} ({DISAGREEMENT_SCALE}{against}), {differ}"
