"""Real QA datasets through ``datasets``: LongBench QA subsets and SQuAD v2 (answerable questions only).

Names: ``longbench/<subset>`` (subset in LONGBENCH_SUBSETS; hub dataset ``THUDM/LongBench``, split ``test``,
fields context / input / answers) and ``squad_v2`` (hub dataset ``rajpurkar/squad_v2``, split ``validation``,
fields context / question / answers.text). SQuAD v2 questions without an answer are dropped: string-match
scoring has no gold string for "unanswerable", and kvcert measures eviction damage on answerable questions.

``data_dir`` replaces the hub: a folder written by ``Dataset.save_to_disk`` (or a ``DatasetDict`` one, the split is
taken from it), or a folder / file of JSON lines with the same fields (for LongBench ``<subset>.jsonl`` is
preferred, as in its data.zip). Examples are a seeded sample without replacement, in sample order. Every failure
is a one-line TaskError. Contexts are returned whole; LongBench contexts can exceed a small model's window, so the
caller truncates (see ``truncate_middle``).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from kvcert.tasks.haystack import TaskError
from kvcert.tasks.ruler import Example

LONGBENCH_SUBSETS: tuple[str, ...] = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique")
_HUB = {"squad_v2": ("rajpurkar/squad_v2", None, "validation")}


def _spec(name: str) -> tuple[str, str | None, str, str]:
    """(hub id, config, default split, task name) of a dataset name."""
    if name in _HUB:
        hub, config, split = _HUB[name]
        return hub, config, split, name
    if name.startswith("longbench/"):
        subset = name.split("/", 1)[1]
        if subset not in LONGBENCH_SUBSETS:
            raise TaskError(f"unknown LongBench subset '{subset}': use one of {', '.join(LONGBENCH_SUBSETS)}")
        return "THUDM/LongBench", subset, "test", f"longbench_{subset}"
    raise TaskError(f"unknown dataset '{name}': use squad_v2 or longbench/<subset>")


def _offline_error(name: str, hub: str, config: str | None) -> TaskError:
    args = f"'{hub}'" + (f", '{config}'" if config else "")
    return TaskError(
        f"dataset '{name}' is not available offline: run "
        f'`python -c "import datasets; datasets.load_dataset({args})"` with network, or pass data_dir=<folder>'
    )


def _load_local(data_dir: str, config: str | None, split: str) -> list[dict]:
    import datasets

    path = Path(data_dir).expanduser()
    if not path.exists():
        raise TaskError(f"data_dir '{data_dir}' does not exist")
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise TaskError(f"data_dir '{data_dir}' has no split '{split}' (it has {', '.join(loaded)})")
            loaded = loaded[split]
        return list(loaded)
    if path.is_dir():
        files = sorted(path.glob(f"{config}.jsonl")) if config else []
        files = files or sorted(path.glob(f"*{split}*.jsonl")) or sorted(path.glob("*.jsonl"))
        if not files:
            raise TaskError(f"data_dir '{data_dir}' has no saved dataset and no .jsonl files")
    else:
        files = [path]
    loaded = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train")
    return list(loaded)


def _load_hub(name: str, hub: str, config: str | None, split: str) -> list[dict]:
    import datasets

    try:
        loaded = datasets.load_dataset(hub, config, split=split) if config else datasets.load_dataset(hub, split=split)
    except Exception:  # offline, not cached, or a hub error: the user needs one line, not a trace
        raise _offline_error(name, hub, config) from None
    return list(loaded)


def _answers(row: dict) -> tuple[str, ...]:
    raw = row.get("answers")
    if isinstance(raw, dict):  # SQuAD: {"text": [...], "answer_start": [...]}
        raw = raw.get("text", [])
    if isinstance(raw, str):
        raw = [raw]
    return tuple(dict.fromkeys(str(a).strip() for a in (raw or []) if str(a).strip()))


def load_dataset_examples(
    name: str, n: int, seed: int, split: str | None = None, data_dir: str | None = None
) -> list[Example]:
    """n examples of a real dataset (``longbench/<subset>`` or ``squad_v2``), a seeded sample of its rows."""
    hub, config, default_split, task = _spec(name)
    split = split or default_split
    rows = _load_local(data_dir, config, split) if data_dir else _load_hub(name, hub, config, split)
    usable = []
    for i, row in enumerate(rows):
        question = row.get("input") if "input" in row else row.get("question")
        answers = _answers(row)
        if row.get("context") and question and answers:
            usable.append((i, row, str(question).strip(), answers))
    if len(usable) < n:
        raise TaskError(f"dataset '{name}' has {len(usable)} answerable rows in split '{split}', asked for {n}")
    chosen = random.Random(f"kvcert|{name}|{split}|{seed}").sample(usable, n)
    examples = []
    for i, row, question, answers in chosen:
        row_id = str(row.get("_id") or row.get("id") or i)
        examples.append(
            Example(
                id=f"{task}-s{seed}-{row_id}",
                task=task,
                context=str(row["context"]).strip(),
                question=question,
                answers=answers,
                depth=math.nan,
                metric="f1",
                target_tokens=0,
            )
        )
    return examples


TRUNCATION_SIDES = ("left", "right", "middle")


def truncate(example: Example, tokenizer, max_tokens: int, side: str = "middle") -> Example:
    """The example with its context cut to at most about max_tokens tokens: ``left`` drops the start (keeps the
    end), ``right`` drops the end, ``middle`` keeps the first and last halves (LongBench's, ``truncate_middle``)."""
    if side == "middle":
        return truncate_middle(example, tokenizer, max_tokens)
    if side not in TRUNCATION_SIDES:
        raise TaskError(f"truncation side '{side}': use one of {', '.join(TRUNCATION_SIDES)}")
    ids = tokenizer(example.context, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return example
    kept = ids[-max_tokens:] if side == "left" else ids[:max_tokens]
    return Example(**{**example.__dict__, "context": tokenizer.decode(kept, skip_special_tokens=True).strip()})


def truncate_middle(example: Example, tokenizer, max_tokens: int) -> Example:
    """LongBench's truncation: keep the first and last max_tokens/2 context tokens, drop the middle."""
    ids = tokenizer(example.context, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return example
    half = max_tokens // 2
    text = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-(max_tokens - half) :], skip_special_tokens=True
    )
    return Example(**{**example.__dict__, "context": text})
