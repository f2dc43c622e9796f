"""`make kvpress-check`: kvcert's ported scorers against kvpress 0.5.5 itself, on a packaged model (float32).

    python -m kvcert.bench.kvpress_check [--model smollm2] [--n 8] [--context-tokens 1024] [--budget 0.25]
        [--out outputs/kvpress_check] [--report STEM]

--model: a packaged model (default SmolLM2-135M, e.g. `qwen2.5`); the kvpress side loads kvcert's converted folder
(`default_cache_dir() / <name>`) with plain `from_pretrained`. For another model than the default, the working files
go to outputs/kvpress_check_<model> and the report also to results/bench/kvpress_check_<model>_cpu.md / .json (model
name without dots, e.g. qwen25), so SmolLM2's files are never overwritten.

kvpress requires transformers < 5.3 and kvcert pins 5.24, so the kvpress side runs in its own environment
(.venv-kvpress from requirements/kvpress.lock) as a subprocess (kvcert/bench/kvpress_side.py), on the same token ids:
N prompts of the study tasks (the five RULER-style tasks in turn, seeds disjoint from the studies'), the context
[0, question_start) compressed as kvpress's pipeline does, then the question and a greedy answer. kvcert's side runs
the ported scorer with the top-k design and compress_after="context" (kvpress's protocol), window 64 (SnapKV's).
Both keep the same count: kvcert round(budget * context); kvpress gets the compression ratio 1 - (that + 0.5) /
context per prompt, so its int(context * (1 - ratio)) is the same count.

Reported per press: the share of (prompt, layer, KV head) whose kept sets are identical, the share of the differing
ones that sit at a near-tie of kvcert's scores (the boundary tokens' scores within a relative 1e-4), the mean number
of tokens that differ there, and the share of prompts with identical greedy answers (token ids up to EOS).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers.utils import logging as hf_logging

from kvcert.core import keep_count
from kvcert.hf import DecodeOptions, Prefill, Prompt
from kvcert.hf.loading import EMBEDDED_MODELS, default_cache_dir, load_model, resolve_name
from kvcert.policy import Policy
from kvcert.tasks import TASKS, make_examples, render

MODEL = "smollm2-135m-instruct"
SEED = 9340  # disjoint from the studies' seeds
WINDOW = 64  # SnapKV's window_size default in kvpress 0.5.5
NEAR_TIE = 1e-4
# kvpress press -> kvcert scorer (several rows may share a press)
PAIRS = (
    ("SnapKVPress", "snapkv"),
    ("SnapKVPress", "window_context"),
    ("StreamingLLMPress", "streaming"),
    ("KnormPress", "key_norm"),
    ("TOVAPress", "tova"),
    ("ObservedAttentionPress", "observed_attention"),
    ("ExpectedAttentionPress", "expected_attention"),
    ("CriticalKVPress(SnapKVPress)", "critical_snapkv"),
)
SIDE = Path(__file__).with_name("kvpress_side.py")


def prompts(tokenizer, n: int, context_tokens: int, budget: float) -> list[dict]:
    out = []
    for i in range(n):
        (example,) = make_examples(TASKS[i % len(TASKS)], 1, context_tokens, tokenizer, seed=SEED + i)
        r = render(example, tokenizer)
        qs = r.question_start
        kept = keep_count(budget, qs)
        out.append(
            {
                "id": example.id,
                "input_ids": list(r.input_ids),
                "question_start": qs,
                "kept": kept,
                "compression_ratio": 1.0 - (kept + 0.5) / qs,
            }
        )
    return out


def _answer(tokens, eos: set[int]) -> list[int]:
    out = []
    for t in tokens:
        if int(t) < 0 or int(t) in eos:
            break
        out.append(int(t))
    return out


def _near_tie(scores: torch.Tensor, ours: set[int], theirs: set[int]) -> bool:
    """Whether the tokens only one side kept have kvcert scores within NEAR_TIE (relative) of each other."""
    only = sorted((ours - theirs) | (theirs - ours))
    if not only or max(only) >= scores.shape[-1]:  # a difference among always-kept tokens is no tie
        return False
    s = scores[only].double()
    return float((s.max() - s.min()) / s.abs().max().clamp_min(1e-30)) <= NEAR_TIE


def kvcert_side(model, tokenizer, items: list[dict], budget: float, max_new_tokens: int) -> dict:
    """Per scorer: kept sets per prompt (list of per layer (Hkv, kept) arrays), scores, answers."""
    scorers = sorted({s for _, s in PAIRS})
    policies = [Policy(scorer=s, design="topk", budget=budget, compress_after="context") for s in scorers]
    options = DecodeOptions(
        max_new_tokens=max_new_tokens, oracle=False, certificate=False, context_window=WINDOW, backend="torch"
    )
    out = {s: {"kept": [], "scores": [], "answers": []} for s in scorers}
    for item in items:
        prompt = Prompt(input_ids=item["input_ids"], question_start=item["question_start"], example_id=item["id"])
        prefill = Prefill.record(model, prompt, context_window=WINDOW, example_id=item["id"], capture_queries=True)
        for policy in policies:
            comp = prefill._compress_one(policy, options.pool_kernel)
            out[policy.scorer]["kept"].append([idx.sort(-1).values.numpy() for idx in comp.indices])
            scores = [v for k, v in prefill._scores.items() if k[0] == policy.scorer]
            out[policy.scorer]["scores"].append(scores[0] if scores else None)
        results = prefill.compress(policies, options).decode(options, tokenizer)
        for policy, r in zip(policies, results):
            out[policy.scorer]["answers"].append(list(r.tokens))
    return out


def compare(items, ours: dict, kvpress_dir: Path, eos: set[int]) -> list[dict]:
    rows = []
    for press, scorer in PAIRS:
        data = np.load(kvpress_dir / f"{press}.npz")
        same = total = ties = diff_tokens = 0
        for i in range(len(items)):
            theirs = data[f"kept_{i}"]  # (layers, Hkv, kept)
            scores = ours[scorer]["scores"][i]
            for layer, mine in enumerate(ours[scorer]["kept"][i]):
                for head in range(mine.shape[0]):
                    a, b = set(mine[head].tolist()), set(theirs[layer, head].tolist())
                    total += 1
                    if a == b:
                        same += 1
                        continue
                    diff_tokens += len(a ^ b) // 2
                    ties += scores is not None and _near_tie(scores[layer, head], a, b)
        answers = [
            _answer(ours[scorer]["answers"][i], eos) == _answer(data["answers"][i], eos) for i in range(len(items))
        ]
        differ = total - same
        rows.append(
            {
                "press": press,
                "kvcert scorer": scorer,
                "kept-set agreement": same / total,
                "differing at near-ties": (ties / differ) if differ else float("nan"),
                "tokens differing (mean, differing sets)": (diff_tokens / differ) if differ else 0.0,
                "answer agreement": float(np.mean(answers)),
                "N": len(items),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    from kvcert.analysis.tables import markdown_table

    return markdown_table(pd.DataFrame(rows), floatfmt=".4f")


def _slug(model: str) -> str:
    """The model's short file-name part: qwen2.5 -> qwen25, smollm2-135m-instruct -> smollm2."""
    return model.split("-")[0].replace(".", "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL, help="a packaged model (default smollm2-135m-instruct)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--kvpress-python", default=".venv-kvpress/bin/python")
    ap.add_argument("--out", default=None, help="default outputs/kvpress_check (other models: _<model> appended)")
    ap.add_argument("--report", default=None, help="also write STEM.md / STEM.json (other models: results/bench/...)")
    ap.add_argument("--reuse", action="store_true", help="reuse the kvpress side's files in --out")
    args = ap.parse_args(argv)
    name = resolve_name(args.model)
    if name not in EMBEDDED_MODELS:
        ap.error(f"--model {args.model}: not a packaged model ({', '.join(EMBEDDED_MODELS)})")
    default = name == MODEL
    args.out = args.out or ("outputs/kvpress_check" if default else f"outputs/kvpress_check_{_slug(name)}")
    if args.report is None and not default:
        args.report = f"results/bench/kvpress_check_{_slug(name)}_cpu"
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(name)
    items = prompts(tokenizer, args.n, args.context_tokens, args.budget)
    spec = {
        "model_dir": str(default_cache_dir() / name),  # the converted safetensors folder load_model reads
        "presses": sorted({p for p, _ in PAIRS}),
        "max_new_tokens": args.max_new_tokens,
        "prompts": items,
    }
    (out / "prompts.json").write_text(json.dumps(spec))
    seconds = {}
    if not args.reuse:
        t0 = time.perf_counter()
        subprocess.run([args.kvpress_python, str(SIDE), str(out / "prompts.json"), str(out)], check=True)
        seconds["kvpress side"] = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    t0 = time.perf_counter()
    ours = kvcert_side(model, tokenizer, items, args.budget, args.max_new_tokens)
    seconds["kvcert side"] = time.perf_counter() - t0
    rows = compare(items, ours, out, eos)
    table = markdown(rows)
    contexts = [item["question_start"] for item in items]
    title = (
        f"kvpress 0.5.5 vs kvcert (top-k, compress_after=context), {name} float32, N={args.n} prompts of about "
        f"{args.context_tokens} context tokens, budget {args.budget}"
    )
    text = f"{title}\n\n{table}\n"
    (out / "kvpress_check.md").write_text(text)
    (out / "kvpress_check.json").write_text(json.dumps(rows, indent=2))
    if args.report:
        from kvcert.records import cpu_model

        stem = Path(args.report)
        stem.parent.mkdir(parents=True, exist_ok=True)
        timing = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        setup = (
            f"CPU: {cpu_model()}, 1 thread; context tokens {min(contexts)}-{max(contexts)}, kept "
            f"{min(i['kept'] for i in items)}-{max(i['kept'] for i in items)}; wall: {timing}"
        )
        stem.with_name(stem.name + ".md").write_text(f"{title}\n\n{setup}\n\n{table}\n")
        meta = dict(model=name, n=args.n, context_tokens=contexts, budget=args.budget, seconds=seconds)
        stem.with_name(stem.name + ".json").write_text(
            json.dumps(dict(cpu=cpu_model(), args=vars(args), **meta, rows=rows), indent=2)
        )
    print(table)
    print(", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
