"""The Hydra entry point: a cell (model x tasks x lengths x policy grid x budgets x seed) -> Parquet records.

python -m kvcert.run                                  # the default cell
python -m kvcert.run +debug=smoke                     # every design, tiny, < 3 minutes
python -m kvcert.run -m budget=0.25,0.5 seed=0,1,2    # a multirun sweep (hydra/launcher=joblib for processes)
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import hydra
import pandas as pd
import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kvcert.config import (
    RESULT_KEYS,
    ConfigError,
    policies,
    record_content,
    register_configs,
    result_name,
    validate,
)
from kvcert.hf import DecodeOptions, generate_variants, load_model
from kvcert.records import example_frame, provenance, step_frame
from kvcert.run_checks import announce_debug, check_overrides, debug_changes  # noqa: F401  (re-exported)
from kvcert.shards import ShardError, ShardStore, atomic_text
from kvcert.tasks import render

ROOT = Path(__file__).resolve().parents[2]
register_configs()


def config_dir() -> Path:
    """The config folder: the checkout's conf/ when kvcert runs from a checkout, else the copy shipped in the wheel
    (kvcert/conf, package data). Users add their own folder with `hydra.searchpath=[file:///path/to/my_conf]`."""
    checkout = ROOT / "conf"
    if (ROOT / "pyproject.toml").is_file() and (checkout / "config.yaml").is_file():
        return checkout
    return Path(str(importlib.resources.files("kvcert") / "conf"))


def _lock_hash() -> str | None:
    lock = ROOT / "preregistration" / "LOCK.json"
    return hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else None


def load_examples(cfg: DictConfig, tokenizer) -> list:
    from kvcert.tasks import load_dataset_examples, make_examples

    t = cfg.task
    if t.dataset == "jsonl":
        from kvcert.tasks.datasets_hf import truncate

        raw = _jsonl_examples(cfg)
        if t.max_context_tokens is None:
            return raw
        return [truncate(ex, tokenizer, int(t.max_context_tokens), t.truncation) for ex in raw]
    if t.dataset:
        from kvcert.tasks.datasets_hf import truncate_middle

        raw = load_dataset_examples(t.dataset, t.n_examples, cfg.seed, data_dir=t.data_dir)
        return [truncate_middle(ex, tokenizer, max(t.context_tokens)) for ex in raw]
    examples = []
    for task in t.tasks:
        for length in t.context_tokens:
            level = t.difficulty.get(task)  # the task's knob; absent = its default level
            examples += make_examples(
                task, t.n_examples, int(length), tokenizer, seed=cfg.seed, source=t.source, level=level
            )
    return examples


def _jsonl_examples(cfg: DictConfig) -> list:
    """task=jsonl's examples before truncation (every row checked: a bad row is a one-line TaskError)."""
    from kvcert.tasks import load_jsonl_examples

    t = cfg.task
    stops = tuple(t.stop_strings) if t.stop_strings is not None else None
    return load_jsonl_examples(t.path, fields=dict(t.fields), metric=t.metric, n=t.n_examples, stop_strings=stops)


def _record_config(cfg: DictConfig) -> str:
    # the claim id is left out: C1-C7 state the same data and share one folder
    return OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in (*RESULT_KEYS, "name") if k in cfg]))


def progress(message: str, log: Path | None = None, *, echo: bool = True) -> None:
    """One progress line: printed as "[kvcert] <message>" (echo), and with `log` appended to that file with an ISO
    timestamp and flushed at once (a long run can be followed with `tail -f`). No logging framework: Hydra's own
    logging setup is left alone."""
    if echo:
        print(f"[kvcert] {message}", flush=True)
    if log is not None:
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(f"{datetime.now().astimezone().isoformat(timespec='seconds')} [kvcert] {message}\n")
            f.flush()


def _warn(message: str, log: Path | None = None) -> None:
    """A one-line warning: printed to stderr as "[kvcert] <message>", and appended to `log` like a progress line."""
    print(f"[kvcert] {message}", file=sys.stderr, flush=True)
    progress(message, log, echo=False)


def _duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


def _unreadable_yaml(text: str) -> bool:
    """Empty or not YAML at all (a write cut short), as opposed to a config that states something else."""
    try:
        yaml.safe_load(text)
    except yaml.YAMLError:
        return True
    return not text.strip()


def same_records_config(saved: str, current: str) -> bool:
    """Whether a folder's saved config.yaml and the current one state the same records (config.record_content)."""
    try:
        old, new = yaml.safe_load(saved), yaml.safe_load(current)
    except yaml.YAMLError:
        return False
    return isinstance(old, dict) and isinstance(new, dict) and record_content(old) == record_content(new)


def run_cell(
    cfg: DictConfig,
    *,
    model=None,
    tokenizer=None,
    after_shard: Callable[[int], None] | None = None,
    log: Path | None = None,
) -> Path:
    """Run (or resume) one cell; returns its results folder. model/tokenizer may be passed in (tests);
    after_shard(n_written) runs after each written shard (tests use it to simulate a kill). With `log`, every
    progress line (cell start, each shard with examples done / total, elapsed and ETA, cell complete or skipped) is
    also appended, timestamped, to that file; log=None prints exactly what it always did."""
    validate(cfg)
    run_dir = Path(cfg.results_dir) / result_name(cfg)
    config_text = _record_config(cfg)
    saved = run_dir / "config.yaml"
    if saved.exists() and not same_records_config(saved.read_text(), config_text):
        if _unreadable_yaml(saved.read_text()):
            raise ConfigError(
                f"{saved} is empty or not YAML (a write cut short?), so which config its records are of is unknown; "
                "move it aside to resume into this folder, or set name=<new folder>"
            )
        raise ConfigError(f"{run_dir} holds records of a different config; set name=<new folder> or remove it")
    store = ShardStore(run_dir)
    for warning in store.check_merged():  # a complete folder whose merged records cannot be read is merged again
        _warn(warning, log)
    if store.complete:
        progress(f"{run_dir.name}: complete, skipped")
        progress(f"{run_dir.name}: skipped: complete ({run_dir})", log, echo=False)
        return run_dir
    torch.set_num_threads(int(cfg.threads))
    if cfg.task.dataset == "jsonl":
        _jsonl_examples(cfg)  # a bad row fails in one line before a model is loaded
    if model is None:
        model, tokenizer = load_model(
            cfg.model.name, cache_dir=cfg.model.cache_dir, dtype=getattr(torch, cfg.model.dtype), device=cfg.device
        )
    examples = load_examples(cfg, tokenizer)
    store.open()  # nothing is written before the model and the examples exist
    for warning in store.check(expect_steps=cfg.records.steps == "head"):  # unreadable shards: moved aside, redone
        _warn(warning, log)
    atomic_text(config_text, saved)
    atomic_text(
        json.dumps(provenance(ROOT, {"seed": int(cfg.seed)}, _lock_hash()), indent=2), run_dir / "provenance.json"
    )
    variants = policies(cfg)
    started = time.perf_counter()
    todo = [i for i in range(len(examples)) if not store.is_done(i)]
    done = len(examples) - len(todo)
    progress(
        f"{run_dir.name}: start in {run_dir}: {len(examples)} examples, {len(todo)} shards to write"
        f" ({done} already written), {len(variants)} variants, {int(cfg.threads)} threads",
        log,
        echo=False,
    )
    for written, index in enumerate(tqdm(todo, desc=run_dir.name[:60], unit="ex", dynamic_ncols=True, disable=None), 1):
        example = examples[index]
        prompt = render(example, tokenizer, cfg.model.prompt_format)
        results = generate_variants(model, tokenizer, prompt, variants, decode_options(cfg, prompt.stop_strings))
        steps = step_frame(run_dir.name, example.id, results) if cfg.records.steps == "head" else None
        store.write(index, example_frame(run_dir.name, example, len(prompt.input_ids), results), steps)
        if log is not None:
            elapsed = time.perf_counter() - started
            eta = elapsed / written * (len(todo) - written)
            progress(
                f"{run_dir.name}: shard {index} done: {done + written}/{len(examples)} examples, "
                f"elapsed {_duration(elapsed)}, ETA {_duration(eta)}",
                log,
                echo=False,
            )
        if after_shard is not None:
            after_shard(written)
    examples_df, _ = store.merge(len(examples))
    _summary(
        run_dir.name,
        examples_df,
        time.perf_counter() - started,
        log,
        lambda: _warn_full_cache_zero(cfg, examples_df),
    )
    return run_dir


def _warn_full_cache_zero(cfg: DictConfig, df: pd.DataFrame) -> None:
    """One line when the full cache answered none of a cell's examples correctly: the metric, not the cache, is the
    likely cause (a sentence answer under exact match or F1), or the model cannot do the task at all."""
    full = df[df.design == "full"]
    if len(full) and not full.correct.any():
        metric = f"task.metric={cfg.task.metric}" if cfg.task.dataset == "jsonl" else "the task's metric"
        _warn(
            f"warning: the full cache scored 0 of {len(full)} examples on this cell: check the answers in "
            f"examples.parquet against {metric} (task=jsonl: task.metric=contains|exact|f1|pkg.mod:func) before "
            "reading the policies' accuracy",
            None,  # stderr only: the progress log's lines stay those of a run
        )


def decode_options(cfg: DictConfig, stop_strings: tuple[str, ...] = ()) -> DecodeOptions:
    """The `decode` config group as the decoder's options."""
    d = cfg.decode
    return DecodeOptions(
        max_new_tokens=d.max_new_tokens,
        stop_strings=tuple(stop_strings),
        oracle=d.oracle,
        certificate=d.certificate,
        tight_radius=d.tight_radius,
        tight_radius_every=d.tight_radius_every,
        context_window=d.context_window,
        pool_kernel=d.pool_kernel,
        backend=d.backend,
    )


def _summary(
    name: str, df: pd.DataFrame, seconds: float, log: Path | None = None, warn: Callable[[], None] | None = None
) -> None:
    full = df[df.design == "full"]
    cert = df[df.has_certificate & (df.steps_total > 0)]
    cov = cert.steps95.sum() / max(cert.steps_total.sum(), 1)
    progress(
        f"{name}: {full.example_id.nunique()} examples x {df.variant.nunique()} variants in {seconds:.0f}s; "
        f"full-cache accuracy {full.correct.mean():.2f}, policy accuracy {df[df.design != 'full'].correct.mean():.2f}"
        f", certificate coverage {cov:.3f} over {int(cert.steps_total.sum())} (step, layer, head) cells",
        log,
    )
    if warn is not None:  # after the summary line, before the log's closing "complete" line
        warn()
    progress(f"{name}: complete: {full.example_id.nunique()} examples in {_duration(seconds)}", log, echo=False)


def point_job_at(run_dir: Path) -> None:
    """Write the cell folder's path into the Hydra job's output folder (`records`), so that `kvcert report` on a
    multirun folder (and the report at a multirun's end) finds every job's records."""
    from hydra.core.hydra_config import HydraConfig

    try:
        out = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return
    atomic_text(str(Path(run_dir).resolve()) + "\n", out / "records")


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from kvcert.hf import ModelLoadError
    from kvcert.tasks import TaskError

    try:
        announce_debug(cfg, config_dir(), progress)
        point_job_at(run_cell(cfg))
    except (ConfigError, ModelLoadError, TaskError, ShardError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    """`kvcert-run`: the command line's keys checked (one line, exit 2, naming the nearest key), then Hydra."""
    problem = check_overrides(sys.argv[1:], config_dir())
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
