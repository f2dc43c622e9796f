"""Study 4's records (draft, preregistration/study4/PLAN.md): per example, the full-cache answer and, at each budget,
the compressed answer with every answer-level signal, from `kvcert.generate` in serving mode.

Greedy decoding is deterministic and an answer-level escalation to the full cache yields exactly the full cache's
greedy answer (tests/test_serve.py), so these two decodes per budget give every escalation policy's answer at every
rate offline (kvcert.studies.study4.analysis). One row per (example, budget):

    example_id, task, context_tokens, budget, correct, full_correct, certificate (the answer's largest token
    certificate, the shipped calibration's multipliers and reduction), logprob (its lowest token log-probability),
    probe_error, probe_certificate, n_answer, kv_bytes, full_kv_bytes, prompt_tokens, answer, full_answer

Rows are appended to `answers.jsonl` as each example finishes (flushed and fsync'ed); a rerun skips the examples
already there, so a killed run resumes where it stopped.

    python -m kvcert.studies.study4.collect --model smollm2-135m-instruct --tasks needle_reworded,word_needle \
        --lengths 1024 --n 4 --seed 8500 --budgets 0.25,0.5 --out results/study4/pilot/smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

BUDGETS = (0.5, 0.25, 0.125)  # 0.5 primary, 0.25 secondary, 0.125 the lowest rung of the tolerance ladder
MAX_NEW_TOKENS = 24


def _row_kv_bytes(batch) -> list[int]:
    """Bytes each row of a CompressedBatch holds: its bucket's buffers split evenly over the bucket's rows (a
    bucket's rows share one width), padding and the slots reserved for the tokens to come included, as
    `kvcert.serve.generate.kv_bytes` counts for a batch of one."""
    out = []
    for bucket in batch.state.buckets:
        total = sum(
            buf.keys.numel() * buf.keys.element_size() + buf.values.numel() * buf.values.element_size()
            for buf in bucket.layers
        )
        out += [total // bucket.batch_size] * bucket.batch_size
    return out


def example_rows(model, tokenizer, example, budgets: Sequence[float], *, model_name: str, seed: int = 0) -> list[dict]:
    """One read of the prompt for the full cache and every budget (kvcert.generate's serving path: the same prompt,
    policy, draws, calibration and certificate), every row decoded in one batch; then one row per budget with the
    compressed answer's signals and the full cache's answer (see the module doc)."""
    import torch

    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading
    from kvcert.policy import FULL
    from kvcert.serve.certificate import token_certificate
    from kvcert.serve.generate import default_policy, full_cache_bytes, resolve_calibration
    from kvcert.serve.probe import summarize
    from kvcert.tasks import score

    fmt = "auto"
    from kvcert.hf.loading import EMBEDDED_MODELS, embedded_prompt_format
    from kvcert.tasks import render

    if model_name in EMBEDDED_MODELS:
        fmt = embedded_prompt_format(model_name)
    rendered = render(example, tokenizer, fmt)  # the task's own prompt, its answer prefix included (as studies 1-3)
    ids, qs, stops = list(rendered.input_ids), int(rendered.question_start), tuple(rendered.stop_strings)
    policies = [FULL] + [default_policy(float(b)) for b in budgets]
    opts = DecodeOptions(max_new_tokens=MAX_NEW_TOKENS, stop_strings=tuple(stops), oracle=False, certificate=True)
    prompt = Prompt(input_ids=ids, question_start=qs, example_id=f"kvcert-generate-{seed}")
    batch = compress_while_reading(model, prompt, policies, opts, probe=len(policies) > 1)
    row_bytes = dict(zip(batch.rows, _row_kv_bytes(batch)))
    results = batch.decode(opts, tokenizer)
    full = results[0]
    full_correct = bool(score(full.answer, example)[1])
    n_layers = int(model.config.num_hidden_layers)
    if not budgets:  # the level pilot: the full cache's answer only
        return [
            dict(
                example_id=example.id,
                task=example.task,
                context_tokens=int(example.target_tokens),
                budget=1.0,
                correct=full_correct,
                full_correct=full_correct,
                answer=full.answer,
                full_answer=full.answer,
            )
        ]
    rows = []
    for i, budget in enumerate(budgets, start=1):
        policy, out = policies[i], results[i]
        cal, label = resolve_calibration("auto", model_name, n_layers, policy)
        multipliers = cal.multiplier_tensor() if cal is not None else None
        reduction = cal.reduction if cal is not None else "max"
        # generate's tokens: the first (read with the full prompt: certificate 0), then one per decode step
        certs = [0.0]
        n = out.n_answer
        if n > 1 and "variance" in out.stats:
            stats = {k: torch.from_numpy(out.stats[k][: n - 1]) for k in ("variance", "trace_c2", "out_norm")}
            certs += token_certificate(stats, multipliers, reduction)[0].tolist()
        certs = certs[:n]
        finite = [c for c in certs if math.isfinite(c)]
        probe = summarize(
            batch.probes[i],
            float(budget),
            certified=policy.has_certificate,
            multipliers=multipliers,
            reduction=reduction,
            risk_model=cal.probe_risk if cal is not None else None,
        )
        rows.append(
            dict(
                example_id=example.id,
                task=example.task,
                context_tokens=int(example.target_tokens),
                budget=float(budget),
                correct=bool(score(out.answer, example)[1]),
                full_correct=full_correct,
                certificate=max(finite) if finite else math.nan,
                logprob=min(out.logprobs[:n]) if n else math.nan,
                probe_error=probe.error,
                probe_certificate=probe.certificate,
                n_answer=n,
                kv_bytes=int(row_bytes[i]),
                full_kv_bytes=int(full_cache_bytes(model, len(ids), MAX_NEW_TOKENS)),
                prompt_tokens=len(ids),
                calibration=label,
                answer=out.answer,
                full_answer=full.answer,
                token_certificates=certs,
                token_logprobs=list(out.logprobs[:n]),
                tokens=list(out.tokens[:n]),
            )
        )
    return rows


def token_level_answer(model, tokenizer, example, prefix: list[int], *, model_name: str, seed: int = 0) -> dict:
    """Today's token-level escalation (`scope="token"`) to the full cache, for an answer whose token `len(prefix)`
    crossed the threshold: the compressed answer's tokens before it are kept, the prompt and those tokens are read
    again with the full cache, and the answer continues there (what `kvcert.generate` does on such an escalation)."""
    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading
    from kvcert.hf.decode import answer_length, eos_ids
    from kvcert.hf.loading import EMBEDDED_MODELS, embedded_prompt_format
    from kvcert.policy import FULL
    from kvcert.tasks import render, score

    fmt = embedded_prompt_format(model_name) if model_name in EMBEDDED_MODELS else "auto"
    rendered = render(example, tokenizer, fmt)
    ids, stops = list(rendered.input_ids), tuple(rendered.stop_strings)
    opts = DecodeOptions(max_new_tokens=MAX_NEW_TOKENS - len(prefix), stop_strings=stops, oracle=False)
    prompt = Prompt(input_ids=ids + list(prefix), question_start=int(rendered.question_start),
                    example_id=f"kvcert-generate-{seed}")  # fmt: skip
    out = compress_while_reading(model, prompt, [FULL], opts).decode(opts, tokenizer)[0]
    tokens = list(prefix) + list(out.tokens)
    n, text = answer_length(tokenizer, tokens, eos_ids(model, tokenizer), stops)
    return dict(example_id=example.id, kept=len(prefix), answer=text, correct=bool(score(text, example)[1]),
                tokens=tokens[:n])  # fmt: skip


def _drop_partial_line(path: Path) -> None:
    """A kill mid-write leaves a last line without its newline: cut it, so the next append starts clean."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _done(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    _drop_partial_line(path)
    done = set()
    for line in path.read_text().splitlines():
        try:
            done.add(json.loads(line)["example_id"])
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut short by a kill: its example is redone
    return done


def _append(path: Path, rows: list[dict]) -> None:
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, allow_nan=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def collect(
    model,
    tokenizer,
    examples,
    budgets: Sequence[float],
    out_dir: str | Path,
    *,
    model_name: str,
    log=print,
) -> Path:
    """Every example not yet in out_dir/answers.jsonl, appended as it finishes; returns the file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "answers.jsonl"
    done = _done(path)
    todo = [e for e in examples if e.id not in done]
    started = time.perf_counter()
    for i, example in enumerate(todo):
        _append(path, example_rows(model, tokenizer, example, budgets, model_name=model_name))
        if log is not None:
            log(f"  {i + 1}/{len(todo)} {example.id} ({time.perf_counter() - started:.0f} s)")
    return path


def load_answers(path: str | Path):
    """answers.jsonl as a DataFrame (a last line cut short by a kill is skipped)."""
    import pandas as pd

    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    from kvcert.hf import load_model
    from kvcert.tasks import make_examples

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tasks", required=True, help="comma-separated task names")
    p.add_argument("--lengths", default="1024")
    p.add_argument("--n", type=int, default=4, help="examples per task and length")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS))
    p.add_argument("--difficulty", default="", help="task=level,... (study 3's levels, the pilot's)")
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    levels = {k: int(v) for k, v in (x.split("=") for x in args.difficulty.split(",") if x)}
    examples = []
    for task in args.tasks.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            examples += make_examples(task, args.n, length, tokenizer, seed=args.seed, level=levels.get(task))
    budgets = [float(b) for b in args.budgets.split(",") if b]  # "": the full cache only (a level pilot)
    path = collect(model, tokenizer, examples, budgets, args.out, model_name=args.model)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
