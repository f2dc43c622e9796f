"""Full-cache accuracy of the offline tasks on a model: which tasks are neither trivial nor hopeless.

    python -m kvcert.tasks.calibrate --n 50 --lengths 1000 2000 4000 --out results/tables/task_calibration.csv

Plain ``model.generate`` with the full cache, greedy, ``MAX_NEW_TOKENS`` new tokens, the render's stop strings.
Writes one row per task x length (accuracy, mean score, mean prompt tokens, seconds) and, with
``--predictions``, every answer as JSON lines. ``--n-per-length`` overrides n for given lengths (e.g. 4000=20).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

from kvcert.tasks.haystack import TaskError
from kvcert.tasks.render import render
from kvcert.tasks.ruler import MAX_NEW_TOKENS, TASKS, make_examples
from kvcert.tasks.scoring import score

FIELDS = ["task", "context_tokens", "n", "accuracy", "mean_score", "mean_prompt_tokens", "seconds", "notes"]


def _parse_overrides(items: list[str]) -> dict[int, int]:
    out = {}
    for item in items:
        length, _, n = item.partition("=")
        out[int(length)] = int(n)
    return out


def generate_answer(model, tokenizer, input_ids: list[int], stop_strings: tuple[str, ...], max_new_tokens: int) -> str:
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            stop_strings=list(stop_strings),
            tokenizer=tokenizer,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1000, 2000, 4000])
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--n-per-length", nargs="*", default=[], help="LENGTH=N overrides, e.g. 4000=20")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source", default="paul_graham")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--out", default="results/tables/task_calibration.csv")
    parser.add_argument("--predictions", default=None, help="optional JSON-lines file of every answer")
    parser.add_argument("--notes", default="", help="free text copied into every row")
    args = parser.parse_args(argv)

    from kvcert.hf.loading import ModelLoadError, load_model

    torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_model(args.model)
    except ModelLoadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    overrides = _parse_overrides(args.n_per_length)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pred_file = open(args.predictions, "w") if args.predictions else None  # noqa: SIM115 - closed below
    rows = []
    try:
        for length in args.lengths:
            n = overrides.get(length, args.n)
            for task in args.tasks:
                start = time.perf_counter()
                try:
                    examples = make_examples(task, n, length, tokenizer, args.seed, source=args.source)
                except TaskError as err:
                    print(f"error: {err}", file=sys.stderr)
                    return 2
                correct, scores, prompt_tokens = 0, [], []
                for ex in examples:
                    rendered = render(ex, tokenizer)
                    answer = generate_answer(
                        model, tokenizer, rendered.input_ids, rendered.stop_strings, args.max_new_tokens
                    )
                    value, ok = score(answer, ex)
                    correct += ok
                    scores.append(value)
                    prompt_tokens.append(len(rendered.input_ids))
                    if pred_file:
                        record = {"id": ex.id, "answer": answer, "gold": list(ex.answers), "correct": ok}
                        pred_file.write(json.dumps({**record, "depth": round(ex.depth, 3)}) + "\n")
                        pred_file.flush()
                seconds = time.perf_counter() - start
                row = {
                    "task": task,
                    "context_tokens": length,
                    "n": n,
                    "accuracy": round(correct / max(n, 1), 4),
                    "mean_score": round(sum(scores) / max(n, 1), 4),
                    "mean_prompt_tokens": round(sum(prompt_tokens) / max(n, 1), 1),
                    "seconds": round(seconds, 1),
                    "notes": args.notes,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                # rewrite after every cell so a killed run keeps what it measured
                with out.open("w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=FIELDS)
                    writer.writeheader()
                    writer.writerows(rows)
    finally:
        if pred_file:
            pred_file.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
