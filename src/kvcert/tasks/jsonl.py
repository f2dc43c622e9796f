"""Your own data: a JSON-lines file (one object per line) -> Examples labelled with the file's stem.

    kvcert-run task=jsonl task.path=/data/my_qa.jsonl task.max_context_tokens=4000

Each row needs a context, a question and its gold answers (field names in ``task.fields``; defaults ``context``,
``question``, ``answers``). ``answers`` is a string or a non-empty list of strings. Row n is line n of the file
(blank lines are skipped). The whole file is checked before anything runs: the first bad row is one line naming
the row, the field and what is wrong (with the count of further bad rows). Examples keep file order; ``n`` takes
the first n rows (None: every row). The default metric is ``contains`` (correct when a gold answer appears in the
model's answer, any case), so that a chat model's correct sentence ("The key is under the blue mat.") scores correct;
token F1 >= 0.5 (``f1``) fails such sentences.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvcert.tasks.haystack import TaskError
from kvcert.tasks.ruler import Example

FIELDS = ("context", "question", "answers")


def _type(value) -> str:
    return "null" if value is None else type(value).__name__


def _row_problem(row, fields: dict[str, str]) -> str | None:
    """What is wrong with a parsed row (naming the field), or None."""
    if not isinstance(row, dict):
        return f"is a JSON {_type(row)}, not an object"
    for key in ("context", "question"):
        name = fields[key]
        if name not in row:
            return f"has no field '{name}' (if yours is named otherwise: task.fields.{key}=<name>)"
        if not isinstance(row[name], str):
            return f"field '{name}' is a {_type(row[name])}, expected a string"
        if not row[name].strip():
            return f"field '{name}' is empty"
    name = fields["answers"]
    if name not in row:
        return f"has no field '{name}' (if yours is named otherwise: task.fields.answers=<name>)"
    answers = row[name]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list):
        return f"field '{name}' is a {_type(answers)}, expected a string or a list of strings"
    odd = [a for a in answers if not isinstance(a, str)]
    if odd:
        return f"field '{name}' holds a {_type(odd[0])} ({json.dumps(odd[0])[:20]}), expected strings"
    if not any(a.strip() for a in answers):
        return f"field '{name}' has no non-empty answer; give at least one gold answer"
    return None


def load_jsonl_examples(
    path: str | Path,
    *,
    fields: dict[str, str] | None = None,
    metric: str = "contains",
    n: int | None = None,
    stop_strings: tuple[str, ...] | None = None,
) -> list[Example]:
    """The examples of a JSON-lines file (see the module docstring); every failure is a one-line TaskError."""
    fields = {**dict(zip(FIELDS, FIELDS)), **(fields or {})}
    file = Path(path).expanduser()
    if not file.is_file():
        raise TaskError(f"task.path={path}: no such file; pass a JSON-lines file (one object per line)")
    task = file.stem
    examples, bad = [], []
    with file.open(encoding="utf-8") as lines:
        for row_number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                bad.append(f"row {row_number} is not valid JSON ({err.msg} at column {err.colno})")
                continue
            problem = _row_problem(row, fields)
            if problem:
                bad.append(f"row {row_number} {problem}")
                continue
            answers = row[fields["answers"]]
            answers = [answers] if isinstance(answers, str) else answers
            examples.append(
                Example(
                    id=f"{task}-{row_number:06d}",
                    task=task,
                    context=row[fields["context"]].strip(),
                    question=row[fields["question"]].strip(),
                    answers=tuple(dict.fromkeys(a.strip() for a in answers if a.strip())),
                    depth=math.nan,
                    metric=metric,
                    target_tokens=0,
                    stop_strings=stop_strings,
                )
            )
    if bad:
        more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
        raise TaskError(f"{file.name}: {bad[0]}{more}; nothing was run")
    if not examples:
        raise TaskError(f"{file.name} has no rows; write one JSON object per line")
    if n is not None and n > len(examples):
        raise TaskError(f"{file.name} has {len(examples)} rows, task.n_examples={n}; set task.n_examples=null for all")
    return examples if n is None else examples[:n]
