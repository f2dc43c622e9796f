"""`kvcert.calibrate_budget`: the smallest KV budget whose risk of changing the answer is at most alpha on the
user's own prompts, with a guarantee (`kvcert.core.risk_control`: Learn-then-Test or conformal risk control), pooled
and per kind of prompt, written as one file (`kvcert.serve.budget_file.BudgetFile`) that `generate(budget=...)` uses.

    kvcert calibrate-budget --model smollm2 --data my.jsonl [--group-field kind] --alpha 0.1 --delta 0.1 \
        [--method ltt|crc] [--loss differs|accuracy] [--ladder 0.1,0.25,0.5,0.75] --out calibrated.json
    kvcert calibrate-budget --model smollm2 --tasks single_needle,fact_qa --lengths 512,1024 --n 30 --out b.json

Per prompt, the full cache and every rung of the ladder are decoded from one shared read of the prompt
(`kvcert.hf.generate_variants`, serving mode: each layer compressed inside the prefill forward, the policy the
studies' randomized one unless given), greedily, up to max_new_tokens. The loss at a rung is 1 when its answer differs
from the full cache's (`differs`, the default: no labels needed; answers compared as stripped text), or the score
it lost against the full cache, max(0, s_full - s_rung), by the row's metric (`accuracy`: needs gold answers). Groups:
a JSONL field (`group_field`), or task x length for the packaged tasks. The KV share of a rung for a prompt is
(kept prompt tokens + reserved answer slots) / (prompt tokens + reserved slots), the engine's own accounting
(`VariantResult.kept_tokens`, the mean over the compressed layers and heads; `kvcert.serve.generate.full_cache_bytes`
for the MiB).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvcert.core.risk_control import METHODS, RiskControlError, refusal, select_groups
from kvcert.serve.budget_file import BudgetError, BudgetFile

DEFAULT_LADDER = (0.1, 0.25, 0.5, 0.75)
LOSSES = ("differs", "accuracy")
DEFAULT_MAX_NEW_TOKENS = 32
TASK_GROUPS = "task x length"


def load_prompts(path, *, group_field: str | None = None, fields: dict | None = None, metric: str = "f1",
                 need_answers: bool = False, n: int | None = None) -> tuple[list, list[str]]:  # fmt: skip
    """(examples, groups) of a JSONL file in `kvcert-run task=jsonl`'s format. Without need_answers (the `differs`
    loss) rows may omit the answers; group_field names the field that gives each row's kind (a string or number)."""
    from kvcert.tasks import load_jsonl_examples
    from kvcert.tasks.haystack import TaskError

    file = Path(path).expanduser()
    names = {"context": "context", "question": "question", "answers": "answers", **(fields or {})}
    if need_answers or not file.is_file():
        examples = load_jsonl_examples(file, fields=fields, metric=metric, n=n)
    else:  # the differs loss needs no labels: rows without answers get a stand-in for the loader's checks, then none
        import tempfile

        lines = _lines(file)
        parsed = [_parse(line) for line in lines]
        bare = [isinstance(row, dict) and names["answers"] not in row for row in parsed]
        filled = [json.dumps({**row, names["answers"]: "-"}) + "\n" if b else line
                  for line, row, b in zip(lines, parsed, bare)]  # fmt: skip
        with tempfile.TemporaryDirectory() as folder:  # the same name and rows: the loader's messages and ids match
            tmp = Path(folder) / file.name
            tmp.write_text("".join(filled), encoding="utf-8")
            examples = load_jsonl_examples(tmp, fields=fields, metric=metric, n=n)
        unlabelled = [b for b, line in zip(bare, lines) if line.strip()]
        examples = [replace(ex, answers=()) if b else ex for ex, b in zip(examples, unlabelled)]
    rows = [(number, _parse(line)) for number, line in enumerate(_lines(file), 1) if line.strip()]
    if group_field is None:
        return examples, ["all"] * len(examples)
    groups = []
    for (number, row), _ in zip(rows, examples):
        value = row.get(group_field) if isinstance(row, dict) else None
        if not isinstance(value, str | int) or isinstance(value, bool) or not str(value).strip():
            raise TaskError(f"{file.name}: row {number} has no group field '{group_field}' (a string or an integer); "
                            "give every row one, or leave --group-field out")  # fmt: skip
        groups.append(str(value).strip())
    return examples, groups


def _lines(file: Path) -> list[str]:
    with file.open(encoding="utf-8") as lines:  # split as kvcert.tasks.jsonl reads it, so that row numbers agree
        return list(lines)


def _parse(line: str):
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def collect_losses(model, tokenizer, examples, ladder, *, policy_fields: dict, prompt_format: str = "auto",
                   max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, log=print) -> list[dict]:  # fmt: skip
    """Per example: the full cache's answer and every rung's, from one shared read (see the module docstring), and
    both losses (accuracy only where the example has gold answers) and the KV share per rung (the full cache last)."""
    from kvcert.hf import FULL, DecodeOptions, generate_variants
    from kvcert.policy import Policy
    from kvcert.serve.generate import full_cache_bytes
    from kvcert.tasks import render, score

    rows = [FULL] + [Policy(**policy_fields, budget=b) for b in ladder]
    out, started = [], time.perf_counter()
    for i, example in enumerate(examples):
        prompt = render(example, tokenizer, prompt_format)
        opts = DecodeOptions(max_new_tokens=max_new_tokens, stop_strings=prompt.stop_strings, oracle=False,
                             certificate=False)  # fmt: skip
        results = generate_variants(model, tokenizer, prompt, rows, opts, example_id=example.id)
        full = results[0]
        n_prompt, reserved = len(prompt.input_ids), max_new_tokens + 1
        differs = [float(r.answer.strip() != full.answer.strip()) for r in results[1:]]
        accuracy = None
        if example.answers:
            s_full = score(full.answer, example)[0]
            accuracy = [float(max(0.0, s_full - score(r.answer, example)[0])) for r in results[1:]]
        kv = [min(1.0, (r.kept_tokens + reserved) / (n_prompt + reserved)) for r in results[1:]] + [1.0]
        out.append(dict(id=example.id, task=example.task, prompt_tokens=n_prompt, differs=differs, accuracy=accuracy,
                        kv=kv, full_kv_mib=full_cache_bytes(model, n_prompt, max_new_tokens) / 2**20,
                        full_answer=full.answer, answers=[r.answer for r in results[1:]]))  # fmt: skip
        if log is not None:
            changed = sum(differs)
            log(f"  {i + 1}/{len(examples)} {example.id}: {changed:g} of {len(ladder)} budgets change the answer "
                f"({time.perf_counter() - started:.0f} s)")  # fmt: skip
    return out


def choose(records: list[dict], groups: list[str], ladder, *, alpha: float, delta: float | None, method: str,
           loss: str) -> tuple[dict, dict, dict]:  # fmt: skip
    """(pooled, per group, mean KV) from collected records: kvcert.core.risk_control.select_groups."""
    losses = np.array([r[loss] for r in records], dtype=np.float64).reshape(-1, len(ladder))
    kv = np.array([r["kv"] for r in records], dtype=np.float64)
    pooled, per = select_groups(losses, groups, list(ladder), alpha, delta, method, kv)
    full_mib = float(np.mean([r["full_kv_mib"] for r in records]))
    kinds = pooled.extra.get("per_kind_mean_kv", pooled.mean_kv)
    mean = dict(pooled_share=pooled.mean_kv, per_kind_share=kinds, full_mib=full_mib,
                pooled_mib=pooled.mean_kv * full_mib, per_kind_mib=kinds * full_mib)  # fmt: skip
    return pooled.to_dict(), {g: s.to_dict() for g, s in per.items()}, mean


def calibrate_budget(model, tokenizer, data=None, *, tasks=None, lengths=(1024,), n: int | None = None,
                     seed: int = 5000, group_field: str | None = None, fields: dict | None = None, metric: str = "f1",
                     ladder=DEFAULT_LADDER, alpha: float = 0.1, delta: float | None = 0.1, method: str = "ltt",
                     loss: str = "differs", max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, policy_fields=None,
                     model_name: str | None = None, prompt_format: str | None = None, out=None,
                     log=print) -> BudgetFile:  # fmt: skip
    """Calibrate a budget on a JSONL file (`data`) or the packaged `tasks` at `lengths` (n per task and length,
    make_examples seed `seed`), write it to `out` when given, and return it. Refuses (BudgetError, one line) before
    decoding anything when the prompts are too few for alpha and delta; per group, a group below the minimum is
    refused in the file (its prompts served with the full cache)."""
    from kvcert.serve.generate import default_policy

    if method not in METHODS:
        raise BudgetError(f"method {method!r} is not one of {', '.join(METHODS)}; pass ltt (the default) or crc")
    if loss not in LOSSES:
        raise BudgetError(f"loss {loss!r} is not one of {', '.join(LOSSES)}; pass differs or accuracy")
    ladder = sorted(float(b) for b in ladder)
    if not ladder or any(not 0 < b < 1 for b in ladder) or len(set(ladder)) != len(ladder):
        raise BudgetError(f"ladder {ladder}: pass distinct budgets in (0, 1), e.g. 0.1,0.25,0.5,0.75 (the full "
                          "cache is always the last rung)")  # fmt: skip
    model_name = model_name or getattr(model, "kvcert_name", None)
    if prompt_format is None:
        from kvcert.hf.loading import EMBEDDED_MODELS, embedded_prompt_format

        prompt_format = embedded_prompt_format(model_name) if model_name in EMBEDDED_MODELS else "auto"
    examples, groups, info = _examples(tokenizer, data, tasks, lengths, n, seed, group_field, fields, metric, loss,
                                       prompt_format)  # fmt: skip
    try:
        why = refusal(method, len(examples), alpha, delta if method == "ltt" else None)
    except ValueError as err:
        raise BudgetError(f"{err}; pass --alpha and --delta in (0, 1)") from None
    if why is not None:
        raise BudgetError(why)
    policy_fields = dict(policy_fields or {k: v for k, v in vars(default_policy(0.5)).items() if k != "budget"})
    if log is not None:
        log(f"calibrating a budget for {model_name or 'the model'} on {len(examples)} prompts, ladder "
            f"{', '.join(f'{b:g}' for b in ladder)} and the full cache ({method}, alpha {alpha:g}"
            + (f", delta {delta:g})" if method == "ltt" else ")"))  # fmt: skip
    started = time.perf_counter()
    records = collect_losses(model, tokenizer, examples, ladder, policy_fields=policy_fields,
                             prompt_format=prompt_format, max_new_tokens=max_new_tokens, log=log)  # fmt: skip
    info["wall_s"] = round(time.perf_counter() - started, 1)
    try:
        pooled, per, mean = choose(records, groups, ladder, alpha=alpha, delta=delta, method=method, loss=loss)
    except RiskControlError as err:
        raise BudgetError(str(err)) from None
    prompts = [dict(id=r["id"], group=g, prompt_tokens=r["prompt_tokens"], loss=r[loss], differs=r["differs"],
                    accuracy=r["accuracy"], kv=r["kv"], full_answer=r["full_answer"], answers=r["answers"])
               for r, g in zip(records, groups)]  # fmt: skip
    result = BudgetFile(model=model_name, policy=policy_fields, method=method, alpha=alpha,
                        delta=delta if method == "ltt" else None, loss=loss, ladder=ladder,
                        max_new_tokens=max_new_tokens, prompt_format=prompt_format, n=len(examples), pooled=pooled,
                        groups=per if info.get("group_by") else {}, group_by=info.pop("group_by", None),
                        mean_kv=mean, data=info, prompts=prompts)  # fmt: skip
    if out is not None:
        result.save(out)
    return result


def _examples(tokenizer, data, tasks, lengths, n, seed, group_field, fields, metric, loss, prompt_format):
    """(examples, groups, data info): a JSONL file (its rows, groups from group_field) or the packaged tasks (groups
    task x length). JSONL rows get the answer prefix `generate` gives a prompt without one, so that calibration
    prompts are rendered as served prompts are."""
    from kvcert.tasks import ALL_TASKS, make_examples
    from kvcert.tasks.haystack import TaskError
    from kvcert.tasks.render import default_answer_prefix

    try:
        if data is not None:
            if tasks:
                raise BudgetError("pass a JSONL file or packaged tasks, not both")
            examples, groups = load_prompts(data, group_field=group_field, fields=fields, metric=metric,
                                            need_answers=loss == "accuracy", n=n)  # fmt: skip
            prefix = default_answer_prefix(tokenizer, prompt_format)
            examples = [ex if ex.answer_prefix else replace(ex, answer_prefix=prefix) for ex in examples]
            info = dict(file=str(data), group_by=group_field)
            return examples, groups, info
        tasks = list(tasks or ())
        unknown = [t for t in tasks if t not in ALL_TASKS]
        if unknown or not tasks:
            raise BudgetError(f"unknown task(s) {', '.join(unknown) or '(none)'}; use some of {', '.join(ALL_TASKS)}")
        examples, groups = [], []
        for task in tasks:
            for length in lengths:
                made = make_examples(task, n or 20, int(length), tokenizer, seed=seed)
                examples += made
                groups += [f"{task}@{int(length)}"] * len(made)
    except TaskError as err:  # the loader speaks kvcert-run's overrides; the command's option is --n
        raise BudgetError(str(err).replace("set task.n_examples=null for all", "leave --n out for all")
                          .replace("task.n_examples=", "--n ")) from None  # fmt: skip
    info = dict(tasks=tasks, lengths=[int(x) for x in lengths], n_per_task=n or 20, seed=seed, group_by=TASK_GROUPS)
    return examples, groups, info


def describe(file: BudgetFile) -> str:
    """A few lines: the pooled budget and each group's, their guarantee and mean KV, the risk per rung."""
    from kvcert.serve.budget_file import guarantee_sentence

    lines = [f"pooled: {guarantee_sentence(file.pooled, file.method, file.loss, None)}"]
    rungs = ", ".join(f"{b:g}: {r:.3f}" for b, r in zip(file.ladder, file.pooled["raw_risk"]))
    lines.append(f"  empirical risk per budget: {rungs}")
    for g, sel in file.groups.items():
        lines.append(f"group {g}: {guarantee_sentence(sel, file.method, file.loss, g)}")
    kv = file.mean_kv
    if kv:
        line = f"mean KV: pooled {kv['pooled_share']:.3f} of the full cache ({kv['pooled_mib']:.2f} MiB"
        if file.groups:
            line += f"), per kind {kv['per_kind_share']:.3f} ({kv['per_kind_mib']:.2f} MiB"
        lines.append(line + f"; full {kv['full_mib']:.2f} MiB)")
    return "\n".join(lines)


__all__ = ["DEFAULT_LADDER", "LOSSES", "calibrate_budget", "choose", "collect_losses", "describe", "load_prompts"]
