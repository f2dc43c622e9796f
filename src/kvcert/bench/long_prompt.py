"""Peak memory on long prompts: kvcert's serving read and decode at a budget against plain transformers' greedy
`generate` with the full cache, on the same prompt, each in a fresh process (peak RSS above the loaded, warmed-up
model, sampled; CPU).

    python -m kvcert.bench.long_prompt [--model smollm2-135m-instruct] [--tokens 2048,8192] [--budget 0.25]
        [--max-new-tokens 8] [--out results/bench/long_prompt_<model>_cpu]

kvcert reads the prompt layer by layer: each layer is compressed as soon as its attention ran, its full keys and
values are dropped before the next layer, and the MLP reads the prompt 1,024 tokens at a time
(kvcert.hf.attention.chunked_feed_forward), and past 8,192 tokens a sliding-window layer attends 2,048 queries at
a time (kvcert.hf.attention.causal_attention), so what the read holds above the model is a few hidden states of the
prompt, one layer's keys and values and the kept caches. Plain transformers holds the full cache of every layer and
the MLP activations of the whole prompt. The report gives both peaks, their ratio and the KV bytes kvcert holds
(`.json`: every measurement, plain transformers' tokens included).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvcert.bench.child import MALLOC_ENV, release_free_memory, rss_peak_sampler, serving_memory
from kvcert.bench.common import DEFAULT_MODEL, load, no_eos, synthetic_prompt, write_report


def plain_memory(model, tokens: int, max_new_tokens: int) -> dict:
    """Plain transformers' greedy generate with its full cache: peak RSS above the warmed-up model, and the tokens."""
    from kvcert.bench.child import rss_mb

    ids, _ = synthetic_prompt(model, tokens)
    x = torch.tensor([ids], device=model.device)
    greedy = dict(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    with torch.no_grad(), no_eos(model):
        model.generate(x[:, :64], **greedy)  # warm-up: the allocator and lazily built modules are baseline
        release_free_memory()
        base = rss_mb()
        with rss_peak_sampler() as peak:
            out = model.generate(x, **greedy)
    return dict(rss_baseline_mb=base, rss_peak_mb=peak[0], peak_delta_mb=max(peak[0] - base, 0.0),
                tokens=out[0, len(ids):].tolist())  # fmt: skip


def child(engine: str, model_name: str, tokens: int, budget: float, max_new_tokens: int) -> dict:
    torch.set_num_threads(1)  # memory does not depend on it
    model, _ = load(model_name, "cpu", "float32")
    if engine == "plain":
        return plain_memory(model, tokens, max_new_tokens)
    return serving_memory(model, "cpu", tokens, budget, max_new_tokens)


def run_child(args: list[str]) -> dict:
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, **MALLOC_ENV}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run([sys.executable, "-m", "kvcert.bench.long_prompt", "child", *args], capture_output=True,
                         text=True, env=env, timeout=7200)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"long_prompt child {args} failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["child"]:
        ap = argparse.ArgumentParser(prog="python -m kvcert.bench.long_prompt child")
        ap.add_argument("engine", choices=["plain", "kvcert"])
        ap.add_argument("--model", required=True)
        ap.add_argument("--tokens", type=int, required=True)
        ap.add_argument("--budget", type=float, default=0.25)
        ap.add_argument("--max-new-tokens", type=int, default=8)
        a = ap.parse_args(argv[1:])
        print(json.dumps(child(a.engine, a.model, a.tokens, a.budget, a.max_new_tokens)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", default="2048,8192", help="comma-separated prompt lengths")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--out", default=None, help="default results/bench/long_prompt_<model>_cpu (dots dropped)")
    args = ap.parse_args(argv)
    # no dot in the default name (qwen2.5 -> qwen25): write_report adds .md / .json with with_suffix
    args.out = args.out or f"results/bench/long_prompt_{args.model.split('-')[0].replace('.', '')}_cpu"
    rows, raw = [], {}
    for n in (int(t) for t in args.tokens.split(",")):
        common = ["--model", args.model, "--tokens", str(n), "--max-new-tokens", str(args.max_new_tokens)]
        plain = run_child(["plain", *common])
        ours = run_child(["kvcert", *common, "--budget", str(args.budget)])
        raw[n] = dict(plain=plain, kvcert=ours)
        rows.append(dict(tokens=n, budget=args.budget, plain_peak_mb=round(plain["peak_delta_mb"], 1),
                         kvcert_peak_mb=round(ours["peak_delta_mb"], 1),
                         peak_ratio=round(ours["peak_delta_mb"] / max(plain["peak_delta_mb"], 1e-9), 3),
                         kvcert_kv_mb=round(ours["kv_bytes"] / 2**20, 1)))  # fmt: skip
        print(rows[-1], flush=True)
    text = write_report(
        args.out,
        "# Peak memory on long prompts: kvcert against plain transformers (kvcert.bench.long_prompt)",
        f"1 thread; {args.model}; seeded random prompt tokens; {args.max_new_tokens} new tokens; peak RSS above the "
        "loaded, warmed-up model in a fresh process per row (sampled every 2 ms), plain transformers' greedy "
        f"`generate` with its full cache against kvcert's serving read and decode at budget {args.budget:g} "
        "(window_question x randomized, certificate on).",
        rows,
        args,
        raw,
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
