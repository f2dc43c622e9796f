"""Full-cache accuracy of the offline tasks on a model: which tasks are neither trivial nor hopeless.

    python -m kvcert.tasks.calibrate --n 50 --lengths 1000 2000 4000 --out results/tables/task_calibration.csv
    python -m kvcert.tasks.calibrate --model gemma3-270m --seed 5000 --n 20   # -> task_calibration_gemma3_270m.csv

Plain ``model.generate`` with the full cache, greedy, ``MAX_NEW_TOKENS`` new tokens, the render's stop strings, the
answer cut at the first stop string (as kvcert's decoding does). The prompt format follows the model: an embedded
base model (``gemma3-270m``) or a tokenizer without a chat template renders plain (``--prompt-format`` overrides).
Hybrid sliding-window models are loaded with ``allow_sliding_window=True``: this is plain transformers decoding on
the full cache, the reference kvcert's full-cache variant must reproduce. Writes one row per model x task x length
(accuracy, mean score, mean prompt tokens, seconds, seconds per example) and, with ``--predictions``, every answer as
JSON lines. ``--n-per-length`` overrides n for given lengths (e.g. 4000=20); ``--also-model`` times a second
model on the same examples' settings (its rows go into the same table).
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
from kvcert.tasks.render import render, resolve_prompt_format
from kvcert.tasks.ruler import MAX_NEW_TOKENS, TASKS, make_examples
from kvcert.tasks.scoring import score

FIELDS = [
    "model",
    "task",
    "context_tokens",
    "n",
    "accuracy",
    "mean_score",
    "mean_prompt_tokens",
    "seconds",
    "seconds_per_example",
    "seed",
    "prompt_format",
    "notes",
]


def _parse_overrides(items: list[str]) -> dict[int, int]:
    out = {}
    for item in items:
        length, _, n = item.partition("=")
        out[int(length)] = int(n)
    return out


def default_out(model: str) -> str:
    """results/tables/task_calibration.csv for the default model, task_calibration_<model>.csv otherwise."""
    if model == "smollm2-135m-instruct":
        return "results/tables/task_calibration.csv"
    return f"results/tables/task_calibration_{Path(model).name.replace('-', '_').replace('.', '_')}.csv"


def cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """The answer as kvcert's decoding reports it: the text before the first stop string, stripped."""
    cut = min((text.find(s) for s in stop_strings if s and s in text), default=-1)
    return (text if cut < 0 else text[:cut]).strip()


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
    return cut_at_stop(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), stop_strings)


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
    parser.add_argument(
        "--prompt-format",
        default=None,
        choices=["auto", "chat", "plain"],
        help="default: the embedded model's format, else auto (chat if the tokenizer has a template)",
    )
    parser.add_argument("--also-model", default=None, help="a second model measured in the same run (cost comparison)")
    parser.add_argument("--also-n", type=int, default=None, help="n per cell for --also-model (default: --n)")
    parser.add_argument("--out", default=None, help="default: results/tables/task_calibration[_<model>].csv")
    parser.add_argument("--predictions", default=None, help="optional JSON-lines file of every answer")
    parser.add_argument("--notes", default="", help="free text copied into every row")
    args = parser.parse_args(argv)

    from kvcert.hf.loading import EMBEDDED_MODELS, load_model
    from kvcert.hf.model_support import ModelLoadError

    torch.set_num_threads(args.threads)
    overrides = _parse_overrides(args.n_per_length)
    out = Path(args.out or default_out(args.model))
    out.parent.mkdir(parents=True, exist_ok=True)
    pred_file = open(args.predictions, "w") if args.predictions else None  # noqa: SIM115 - closed below
    rows: list[dict] = []
    models = [(args.model, None)] + ([(args.also_model, args.also_n)] if args.also_model else [])
    try:
        for model_name, n_fixed in models:
            try:
                model, tokenizer = load_model(model_name, allow_sliding_window=True)
            except ModelLoadError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            fmt = args.prompt_format
            if fmt is None:
                fmt = EMBEDDED_MODELS[model_name].prompt_format if model_name in EMBEDDED_MODELS else "auto"
            code = _calibrate(model_name, model, tokenizer, fmt, args, overrides, n_fixed, rows, out, pred_file)
            if code:
                return code
            del model
    finally:
        if pred_file:
            pred_file.close()
    return 0


def _calibrate(model_name, model, tokenizer, fmt, args, overrides, n_fixed, rows, out, pred_file) -> int:
    for length in args.lengths:
        n = n_fixed if n_fixed is not None else overrides.get(length, args.n)
        for task in args.tasks:
            start = time.perf_counter()
            try:
                examples = make_examples(task, n, length, tokenizer, args.seed, source=args.source)
            except TaskError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            correct, scores, prompt_tokens = 0, [], []
            used = resolve_prompt_format(tokenizer, fmt)
            for ex in examples:
                rendered = render(ex, tokenizer, used)
                answer = generate_answer(
                    model, tokenizer, rendered.input_ids, rendered.stop_strings, args.max_new_tokens
                )
                value, ok = score(answer, ex)
                correct += ok
                scores.append(value)
                prompt_tokens.append(len(rendered.input_ids))
                if pred_file:
                    record = {"model": model_name, "id": ex.id, "answer": answer, "gold": list(ex.answers)}
                    record["correct"] = ok
                    pred_file.write(json.dumps({**record, "depth": round(ex.depth, 3)}) + "\n")
                    pred_file.flush()
            seconds = time.perf_counter() - start
            row = {
                "model": model_name,
                "task": task,
                "context_tokens": length,
                "n": n,
                "accuracy": round(correct / max(n, 1), 4),
                "mean_score": round(sum(scores) / max(n, 1), 4),
                "mean_prompt_tokens": round(sum(prompt_tokens) / max(n, 1), 1),
                "seconds": round(seconds, 1),
                "seconds_per_example": round(seconds / max(n, 1), 2),
                "seed": args.seed,
                "prompt_format": used,
                "notes": args.notes,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            # rewrite after every cell so a killed run keeps what it measured
            with out.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=FIELDS)
                writer.writeheader()
                writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
