"""Structured-config schemas (Hydra ConfigStore) and the checks that make a bad config fail at start, in one line."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from kvcert.defaults import DEFAULT_MAX_NEW_TOKENS
from kvcert.policy import DESIGN_NAMES, FULL, SCORER_NAMES, Policy

# change speed, not records: left out of folder hashes. The removed speed switches of the earlier two-path engine
# are listed too, so that folders whose saved config.yaml still holds them keep matching their config
REMOVED_SPEED_KEYS = ("one_batch", "drop_finished", "stats_after_forward", "keys_transposed", "fused_attention")
SPEED_ONLY_KEYS = {"decode": ("backend", *REMOVED_SPEED_KEYS, "packed_weights")}
# hashed only when not the default, so folders of earlier configs keep their names
JSONL_DEFAULTS = {
    "path": None,
    "fields": {"context": "context", "question": "question", "answers": "answers"},
    "metric": "f1",
    "stop_strings": None,
    "max_context_tokens": None,
    "truncation": "middle",
}
DEFAULT_ONLY_KEYS = {
    "model": {"prompt_format": "auto"},
    "decode": {"tight_radius": True, "tight_radius_every": 1},
    "task": {**JSONL_DEFAULTS, "difficulty": {}},
}
OPTIONAL_ENTRY_KEYS = ("compress_after", "protect_question")  # hashed only when set, so old folders keep their names


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key, the value and what is allowed."""


@dataclass
class ModelConfig:
    name: str = MISSING
    dtype: str = "float32"
    cache_dir: str | None = None
    prompt_format: str = "auto"  # auto (chat template if the tokenizer has one, else plain) | chat | plain


@dataclass
class TaskFields:
    context: str = "context"
    question: str = "question"
    answers: str = "answers"


@dataclass
class TaskConfig:
    tasks: list[str] = field(default_factory=list)
    n_examples: int | None = 4  # None: every row (task=jsonl only)
    context_tokens: list[int] = field(default_factory=lambda: [1000])
    source: str = "paul_graham"
    difficulty: dict[str, int] = field(default_factory=dict)  # {task: level} of its knob (tasks/ruler.py DIFFICULTY)
    dataset: str | None = None  # squad_v2 | longbench/<subset> | jsonl (your own file: the keys below)
    data_dir: str | None = None
    path: str | None = None  # task=jsonl: the JSON-lines file; its stem labels the records
    fields: TaskFields = field(default_factory=TaskFields)  # task=jsonl: the row's field names
    metric: str = "f1"  # task=jsonl: exact | contains | f1 | a callable pkg.mod:func (tasks/scoring.py)
    stop_strings: list[str] | None = None  # task=jsonl: stops besides end of turn; None: first newline or period
    max_context_tokens: int | None = None  # task=jsonl: longer contexts are truncated; None: whole contexts
    truncation: str = "middle"  # task=jsonl: left | right | middle, the part of a long context that is dropped


@dataclass
class PolicyEntry:
    scorer: str = MISSING
    designs: list[str] = MISSING
    budgets: list[float] | None = None  # this entry's own budgets instead of the cell's (e.g. ablations at one)
    tail_fraction: float | None = None  # this entry's own design parameters (e.g. a pilot comparing several
    floor: float | None = None  # settings on one shared prefill); None = the policy-level value
    score_power: float | None = None
    compress_after: str | None = None  # prompt | context; None = the scorer's default (README: kvpress)
    protect_question: bool | None = None  # keep the question's tokens (compress_after=prompt); None = default


@dataclass
class PolicyConfig:
    name: str = "custom"
    grid: list[PolicyEntry] = field(default_factory=list)
    tail_fraction: float = 0.5
    floor: float = 0.2
    score_power: float = 1.0


@dataclass
class BudgetsConfig:
    fractions: list[float] = field(default_factory=lambda: [0.5])


@dataclass
class DecodeConfig:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    oracle: bool = True
    certificate: bool = True
    tight_radius: bool = True  # tr(C^2) per cell for radius95_tight (off: NaN, a cheaper certificate)
    tight_radius_every: int = 1  # tr(C^2) every k-th step; between, tr(C^2) / V_hat^2 is carried (cheaper)
    context_window: int = 32
    pool_kernel: int = 5
    backend: str = "auto"  # speed only (not hashed): auto | torch | compiled (the CPU kernel), kvcert.hf.decode


@dataclass
class RecordsConfig:
    steps: str = "head"


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    budgets: BudgetsConfig = field(default_factory=BudgetsConfig)
    budget: float | None = None
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    records: RecordsConfig = field(default_factory=RecordsConfig)
    claim: dict[str, Any] | None = None
    name: str | None = None
    seed: int = 0
    results_dir: str = "results/runs"
    device: str = "cpu"
    threads: int = 2


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=RunConfig)


def _one_of(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {sorted(allowed)}")


def validate(cfg: DictConfig) -> None:
    """Semantic checks beyond the schema's types. Raises ConfigError with one line."""
    from kvcert.tasks import ALL_TASKS

    if not cfg.policy.grid:
        raise ConfigError("policy.grid is empty; add entries like {scorer: window_question, designs: [randomized]}")
    for i, entry in enumerate(cfg.policy.grid):
        _one_of(f"policy.grid[{i}].scorer", entry.scorer, set(SCORER_NAMES) - {"none"})
        for design in entry.designs:
            _one_of(f"policy.grid[{i}].designs", design, set(DESIGN_NAMES) - {"full"})
    if cfg.budget is not None and not 0.0 < cfg.budget <= 1.0:
        raise ConfigError(f"budget={cfg.budget!r}; a budget is the kept fraction of the prompt, in (0, 1]")
    for b in cfg.budgets.fractions:
        if not isinstance(b, (int, float)) or not 0.0 < float(b) <= 1.0:
            raise ConfigError(f"budgets.fractions contains {b!r}; a budget is a kept fraction of the prompt, in (0, 1]")
    try:  # the range checks live in Policy: build every variant once and report its complaint in one line
        policies(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.task.dataset is None:
        if not cfg.task.tasks:
            raise ConfigError("task.tasks is empty and task.dataset is null; name tasks or a dataset")
        for t in cfg.task.tasks:
            _one_of("task.tasks", t, set(ALL_TASKS))
        _validate_difficulty(cfg.task)
    elif cfg.task.difficulty:
        raise ConfigError(f"task.difficulty is for the offline tasks (task.dataset={cfg.task.dataset}); remove it")
    _validate_jsonl(cfg.task)
    if cfg.task.n_examples is None and cfg.task.dataset != "jsonl":
        raise ConfigError("task.n_examples=null (every row) is for task=jsonl only; give a number")
    if cfg.task.n_examples is not None and cfg.task.n_examples < 1:
        raise ConfigError(f"task.n_examples={cfg.task.n_examples} must be >= 1")
    for n in cfg.task.context_tokens:
        if not 64 <= n <= 131072:
            raise ConfigError(f"task.context_tokens contains {n}; use lengths between 64 and 131072 tokens")
    _one_of("records.steps", cfg.records.steps, {"head", "none"})
    _one_of("model.dtype", cfg.model.dtype, {"float32", "bfloat16", "float16"})
    _one_of("model.prompt_format", cfg.model.prompt_format, {"auto", "chat", "plain"})
    _one_of("device", cfg.device.split(":")[0], {"cpu", "cuda"})
    if cfg.decode.max_new_tokens < 1:
        raise ConfigError(f"decode.max_new_tokens={cfg.decode.max_new_tokens} must be >= 1")
    if cfg.decode.tight_radius_every < 1:
        raise ConfigError(
            f"decode.tight_radius_every={cfg.decode.tight_radius_every} must be >= 1 (1 = tr(C^2) at every step)"
        )
    _one_of("decode.backend", cfg.decode.backend, {"auto", "torch", "compiled"})
    if cfg.decode.backend == "compiled" and not cfg.device.startswith("cpu"):
        raise ConfigError(f"decode.backend=compiled is a CPU kernel and device={cfg.device}; set decode.backend=auto")


def _validate_difficulty(task: DictConfig) -> None:
    from kvcert.tasks import TaskError, check_difficulty

    try:
        check_difficulty(OmegaConf.to_container(task.difficulty))
    except TaskError as err:
        raise ConfigError(str(err)) from None


def _validate_jsonl(task: DictConfig) -> None:
    """task=jsonl's keys (the file exists, the metric resolves); elsewhere they must stay at their defaults."""
    if task.dataset != "jsonl":
        for key, default in JSONL_DEFAULTS.items():
            value = OmegaConf.to_container(task[key]) if OmegaConf.is_config(task[key]) else task[key]
            if value != default:
                raise ConfigError(f"task.{key} is read by task=jsonl only (task.dataset={task.dataset}); remove it")
        return
    from kvcert.tasks import TaskError
    from kvcert.tasks.datasets_hf import TRUNCATION_SIDES
    from kvcert.tasks.scoring import BUILTIN_METRICS, metric_function

    if not task.path:
        raise ConfigError("task=jsonl needs task.path=<file.jsonl> (one JSON object per line)")
    if not Path(task.path).expanduser().is_file():
        raise ConfigError(f"task.path={task.path} is not a file; pass a JSON-lines file (one object per line)")
    if task.metric not in BUILTIN_METRICS:
        if "." not in task.metric and ":" not in task.metric:
            raise ConfigError(f"task.metric={task.metric!r}: use exact, contains, f1 or a callable pkg.mod:func")
        try:
            metric_function(task.metric)
        except TaskError as err:
            raise ConfigError(f"task.{err}") from None
    _one_of("task.truncation", task.truncation, set(TRUNCATION_SIDES))
    n = task.max_context_tokens
    if n is not None and not 64 <= n <= 131072:
        raise ConfigError(f"task.max_context_tokens={n}; use null (whole contexts) or 64 to 131072 tokens")
    for stop in task.stop_strings or []:
        if not isinstance(stop, str) or not stop:
            raise ConfigError(f"task.stop_strings contains {stop!r}; stop strings are non-empty strings")
    for key in ("context", "question", "answers"):
        if not task.fields[key]:
            raise ConfigError(f"task.fields.{key} is empty; name the row's {key} field")


def policies(cfg: DictConfig) -> list[Policy]:
    """The variants of a cell: the full-cache reference, then grid x budgets, in config order."""
    out = [FULL]
    p = cfg.policy
    for i, entry in enumerate(p.grid):
        params = {k: p[k] if entry.get(k) is None else entry[k] for k in ("tail_fraction", "floor", "score_power")}
        when = {k: entry[k] for k in OPTIONAL_ENTRY_KEYS if entry.get(k) is not None}
        for design in entry.designs:
            for b in entry.budgets if entry.get("budgets") is not None else budget_list(cfg):
                try:
                    out.append(
                        Policy(scorer=entry.scorer, design=design, budget=float(b), seed=cfg.seed, **params, **when)
                    )
                except ValueError as err:  # name the config key the offending value came from
                    field = str(err).split()[0]
                    if field in params:
                        key = f"policy.grid[{i}].{field}" if entry.get(field) is not None else f"policy.{field}"
                        raise ValueError(f"{key}={params[field]!r}: {err}") from None
                    raise ValueError(f"policy.grid[{i}] ({entry.scorer}, {design}, budget {b}): {err}") from None
    seen = set()
    return [x for x in out if not (x in seen or seen.add(x))]  # an entry repeated by two grid lines runs once


def budget_list(cfg: DictConfig) -> list[float]:
    """The budgets of a cell: the single `budget` when set, else the `budgets` grid."""
    return [float(cfg.budget)] if cfg.budget is not None else [float(b) for b in cfg.budgets.fractions]


RESULT_KEYS = ("model", "task", "policy", "budgets", "budget", "decode", "records", "seed")


def record_content(content: dict) -> dict:
    """What of a config (RESULT_KEYS as plain containers) determines the records: speed-only keys dropped, keys
    hashed only when set dropped at their defaults, unset optional grid-entry keys dropped. Folder names hash it, and
    a folder's saved config matches a new one when their record contents are equal (so a key added to the schema
    later, at its default, neither renames nor orphans earlier folders)."""
    from kvcert.tasks import DIFFICULTY

    content = copy.deepcopy(content)
    task = content.get("task") or {}
    if isinstance(task.get("difficulty"), dict):  # a level at its task's default makes the same examples
        task["difficulty"] = {t: v for t, v in task["difficulty"].items() if DIFFICULTY.get(t, (0, None))[1] != v}
    for group, keys in SPEED_ONLY_KEYS.items():
        for k in keys:
            (content.get(group) or {}).pop(k, None)
    for group, defaults in DEFAULT_ONLY_KEYS.items():
        for k, default in defaults.items():
            if (content.get(group) or {}).get(k, default) == default:
                (content.get(group) or {}).pop(k, None)
    for entry in (content.get("policy") or {}).get("grid") or []:
        for k in OPTIONAL_ENTRY_KEYS:
            if entry.get(k) is None:
                entry.pop(k, None)
    return content


def result_name(cfg: DictConfig) -> str:
    """Folder name from the config: readable parts + a hash of everything that changes the records."""
    if cfg.name:
        return str(cfg.name)
    content = record_content(
        {
            k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
            for k in RESULT_KEYS
        }
    )
    data = Path(cfg.task.path).expanduser() if cfg.task.get("path") else None
    if data is not None and data.is_file():  # task=jsonl: an edited file is new data, so a new folder
        content["task"]["path_sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:8]
    model = str(cfg.model.name).replace("/", "_")
    task = cfg.task.dataset.replace("/", "_") if cfg.task.dataset else "+".join(cfg.task.tasks)
    if len(task) > 40:
        task = f"{len(cfg.task.tasks)}tasks"
    lengths = "-".join(str(n) for n in cfg.task.context_tokens)
    if cfg.task.dataset == "jsonl" and cfg.task.path:
        task, lengths = Path(cfg.task.path).stem, str(cfg.task.max_context_tokens or "whole")
    budgets = "-".join(f"{b:g}" for b in budget_list(cfg))
    return f"{model}__{task}__{lengths}__{cfg.policy.name}__b{budgets}__s{cfg.seed}__{digest}"
