"""The file `kvcert calibrate-budget` writes (`BudgetFile`, format kvcert-budget/1) and what serving reads from it:
`calibrated_budget(path, group)` -> a `CalibratedBudget` (the budget, its policy and the guarantee in one sentence),
and `resolve_budget`, the one call `generate` makes to turn `budget="calibrated.json"` into a number and a policy.

    from kvcert import generate
    out = generate(model, tok, context=doc, question=q, budget="calibrated.json")           # the pooled budget
    out = generate(model, tok, context=doc, question=q, budget=calibrated_budget("calibrated.json", group="qa"))
    print(out.summary())  # ...; budget 0.5 by Learn-then-Test on 120 prompts: with probability >= 0.9 ...
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvcert.serve.calibration import CalibrationError

FORMAT = "kvcert-budget/1"
METHOD_NAMES = {"ltt": "Learn-then-Test", "crc": "conformal risk control"}
LOSS_PHRASES = {
    "differs": "the share of answers that differ from the full cache's",
    "accuracy": "the accuracy lost against the full cache",
}


class BudgetError(CalibrationError):
    """A budget file that cannot be used, or a calibration that cannot be run: one line naming the fix."""


@dataclass
class BudgetFile:
    model: str | None
    policy: dict  # the policy's fields (its budget excluded): the studies' randomized policy by default
    method: str  # "ltt" or "crc"
    alpha: float
    delta: float | None
    loss: str  # "differs" or "accuracy"
    ladder: list[float]
    max_new_tokens: int
    prompt_format: str
    n: int
    pooled: dict  # kvcert.core.risk_control.Selection as a dict
    groups: dict[str, dict] = field(default_factory=dict)  # group -> Selection dict
    group_by: str | None = None  # the JSONL field, "task x length", or None (no groups)
    mean_kv: dict = field(default_factory=dict)  # pooled / per_kind shares and MiB, the full cache's MiB
    data: dict = field(default_factory=dict)
    prompts: list[dict] = field(default_factory=list)  # per prompt: id, group, loss per rung, kv share per rung
    format: str = FORMAT

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_json_safe(asdict(self)), indent=1, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> BudgetFile:
        path = Path(path).expanduser()
        fix = "pass a file `kvcert calibrate-budget` wrote"
        if not path.is_file():
            raise BudgetError(f"budget file {path} does not exist; {fix}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BudgetError(f"budget file {path} is not JSON ({err}); {fix}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise BudgetError(f"{path} is not a kvcert budget file (format {FORMAT}); {fix}")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})

    def selection(self, group: str | None = None) -> dict:
        """The pooled selection, or a group's (BudgetError naming the groups when it has no such group)."""
        if group is None:
            return self.pooled
        if group not in self.groups:
            known = ", ".join(sorted(self.groups)) or "none: the file was calibrated without groups"
            raise BudgetError(f"group {group!r} is not in the budget file (groups: {known}); pass one of them, or no "
                              "group for the pooled budget")  # fmt: skip
        return self.groups[group]


def guarantee_sentence(sel: dict, method: str, loss: str, group: str | None) -> str:
    """The guarantee of one selection in one sentence (what summary() appends)."""
    who = f"group {group}, " if group is not None else ""
    name, alpha = METHOD_NAMES[method], sel["alpha"]
    if sel.get("refused"):
        return f"no guarantee for {who.rstrip(', ')} ({sel['n']} prompts: {sel['refused']}): the full cache"
    if sel["fallback"]:
        return (f"budget: the full cache ({name} on {who}{sel['n']} prompts: no budget below it kept "
                f"{LOSS_PHRASES[loss]} within {alpha:g})")  # fmt: skip
    promise = f"with probability >= {1 - sel['delta']:g} over the calibration prompts" if method == "ltt" else ""
    promise = promise or "in expectation over the calibration prompts and a new one"
    return (f"budget {sel['budget']:g} by {name} on {who}{sel['n']} prompts: {promise}, {LOSS_PHRASES[loss]} is at "
            f"most {alpha:g} on prompts like them")  # fmt: skip


@dataclass(frozen=True)
class CalibratedBudget:
    """What `generate(budget=...)` uses from a budget file: the budget (1.0: the full cache), the policy fields it
    was calibrated with, and the guarantee sentence."""

    budget: float
    policy: dict
    model: str | None
    guarantee: str
    group: str | None = None
    path: str = ""
    alpha: float | None = None  # the risk level the guarantee holds at
    method: str = ""

    def monitor(self, delta: float = 0.05):
        """A `kvcert.core.risk_monitor.RiskMonitor` at this budget's alpha: feed it the loss of each answer checked
        against the full cache (1: it differs); its `line()` says when the stream's risk leaves the guarantee."""
        from kvcert.core.risk_monitor import RiskMonitor

        return RiskMonitor(alpha=float(self.alpha), delta=delta)


def calibrated_budget(path: str | Path, group: str | None = None) -> CalibratedBudget:
    """The budget a file holds for `group` (None: the pooled budget) and its guarantee."""
    file = BudgetFile.load(path)
    sel = file.selection(group)
    sentence = guarantee_sentence(sel, file.method, file.loss, group)
    return CalibratedBudget(float(sel["budget"]), dict(file.policy), file.model, sentence, group, str(path),
                            float(file.alpha), file.method)  # fmt: skip


def resolve_budget(budget, policy, model, tolerance=None):
    """(budget, policy, guarantee) for generate: a number passes through (guarantee None); a budget file's path or
    a CalibratedBudget gives its budget, the policy it was calibrated with (the full cache at 1.0) and its
    guarantee sentence. Refused (BudgetError) with an explicit policy= or tolerance= (each chooses the budget
    otherwise) or for another model than the file's. A
    string is a file when it ends in .json or names one (other text goes on to validate_request's "not a number")."""
    if isinstance(budget, Path) or isinstance(budget, str) and (budget.endswith(".json") or Path(budget).is_file()):
        budget = calibrated_budget(budget)
    if not isinstance(budget, CalibratedBudget):
        return budget, policy, None
    if policy is not None:
        raise BudgetError("a budget file sets the budget and its policy; pass budget= or policy=, not both")
    if tolerance is not None:
        raise BudgetError("tolerance= chooses its own budget; pass a budget file or tolerance=, not both")
    name = getattr(model, "kvcert_name", None)
    if budget.model and name and budget.model != name:
        raise BudgetError(f"the budget file was calibrated for model {budget.model!r}, not {name!r}; run "
                          f"`kvcert calibrate-budget --model {name}`")  # fmt: skip
    from kvcert.policy import FULL, Policy

    chosen = FULL if budget.budget >= 1.0 else Policy(**budget.policy, budget=budget.budget)
    return budget.budget, chosen, budget.guarantee


def _json_safe(value):
    """NaN and infinities -> None, recursively."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value
