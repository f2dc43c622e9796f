"""What `kvcert.generate` returns: `Generation`, the answer's tokens with their certificates, the escalations, the
memory held, the draws' agreement, and a one-line `summary()` that says first which cache the answer came from."""

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


def cache_label(policy: Policy) -> str:
    """The cache a policy keeps, in words: "the full cache" or "<scorer> x <design> @ <budget>"."""
    return "the full cache" if policy.is_full else f"{policy.scorer} x {policy.design} @ {policy.budget:g}"


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
    guarantee: str | None = None  # with budget= a calibrate-budget file: its guarantee in one sentence

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
        """One line: the cache the answer came from (and why), then that answer's certificate, trust and memory, and
        the prefill probe of the cache it started from."""
        certs = [c for c in self.certificate if math.isfinite(c)]
        worst = f"{max(certs):.3f}" if certs else "n/a"
        exact = bool(self.steps) and all(t.budget >= 1.0 for t in self.steps)
        how = "full cache: exact" if exact else f"{self.reduction}, relative radius at 0.95"
        trust = f"{sum(self.trusted)}/{len(self.steps)} tokens trusted"
        if self.calibration is None:
            trust += " (uncalibrated)"
        mem = f"KV {self.kv_bytes / 2**20:.1f} MiB vs full {self.full_kv_bytes / 2**20:.1f} MiB"
        if self.escalations:
            mem += " (the most held, the re-read included)"
        line = f"answer from {self.source()}: certificate max {worst} ({how}), {trust}, {mem}"
        if self.escalation is not None and not self.escalations and self.threshold is not None:
            line += f"; not escalated ({self.escalation.signal} threshold {self.threshold:.3g})"
        if self.probe is not None:
            where = "the discarded cache's " if self.restart is not None else ""
            line += f"; {where}prefill probe error {self.probe.error:.3g}"
        if self.agreement is not None and self.draws is not None:
            # after an escalation the draws speak of the answer they decoded: discarded, or cut at the escalation
            where = "the discarded answer's " if self.restart is not None else ""
            where = "before the escalation, " if self.escalations and not where else where
            line += f"; {where}{draws_phrase(self.draws, self.agreement)}"
        if self.escalator is not None:
            n, k, rate = self.escalator["answers"], self.escalator["escalations"], self.escalator["rate"]
            share = f" ({k / n:.0%})" if n else ""
            line += f"; escalated {k} of {n} answers{share}, target {rate:.0%}"
        if self.guarantee:
            line += f"; {self.guarantee}"
        return line

    def to_dict(self) -> dict:
        out = asdict(self)
        out["policy"] = asdict(self.policy)
        out["summary"] = self.summary()
        return out


def draws_phrase(draws: Draws, agreement: Agreement) -> str:
    """ "draws: 2 independent, disagreement 1.23, 1/1 other draw's answer differs" (split halves: "halves")."""
    split = draws.variant == "split"
    n, k = len(agreement.row_differs), sum(agreement.row_differs)
    one, many = ("half", "halves") if split else ("other draw", "other draws")
    differ = f"{k}/1 {one}'s answer differs" if n == 1 else f"{k}/{n} {many}' answers differ"
    head = "split halves of one draw" if split else f"{draws.count} independent"
    return f"draws: {head}, disagreement {agreement.disagreement:.3g}, {differ}"
