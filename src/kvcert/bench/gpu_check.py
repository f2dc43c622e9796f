"""`make gpu-check`: the CUDA-marked tests and a small decode bench on a GPU, in one script under 5 minutes.

    python -m kvcert.bench.gpu_check [--model smollm2-135m-instruct] [--dtype float32] [--out FILE.json]

Prints the host synchronisations of one decode (CUDA's sync debug mode: one per new token is the target), then, per
(prompt tokens, variants, certificate + oracle on / off): seconds per decode step of the whole variant
set, peak GPU memory (torch.cuda.max_memory_allocated, reset per configuration) and the KV bytes the compressed
caches hold; then serving mode's memory (one policy at budgets 1 / 0.5 / 0.25, oracle off, 4k and 8k tokens) and
its two ratios; then writes them as JSON. Exits 2 with one line when no CUDA device is visible. `--model
smollm2-135m-random` is SmolLM2-135M's shape with random weights, for a machine without the weights package.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvcert.bench.common import load, no_eos, policy_grid, sync, synthetic_prompt
from kvcert.serve.generate import kv_bytes

CONFIGS = [(1024, 8), (1024, 24), (4096, 24)]
SERVING_LENGTHS, SERVING_BUDGETS = (4096, 8176), (1.0, 0.5, 0.25)
STEPS = 16


def bench(model, n: int, variants: int, oracle: bool, device: str = "cuda") -> dict:
    from kvcert.hf import DecodeOptions, Prefill, Prompt, compress_while_reading

    ids, qs = synthetic_prompt(model, n)
    opts = DecodeOptions(max_new_tokens=STEPS, oracle=oracle, certificate=oracle)
    policies = policy_grid(variants)
    cuda = torch.device(device).type == "cuda"
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps: list[float] = []
    last = [0.0]

    def on_step(step: int) -> None:
        sync(device)
        now = time.perf_counter()
        if step:
            steps.append(now - last[0])
        last[0] = now

    with no_eos(model):
        prompt = Prompt(input_ids=ids, question_start=qs, example_id="gpu")
        if oracle:  # verification mode: the full prompt recorded for the oracle
            batch = Prefill.record(model, prompt).compress(policies, opts)
        else:  # serving mode: each layer compressed inside the prefill forward
            batch = compress_while_reading(model, prompt, policies, opts)
        held = kv_bytes(batch)
        batch.decode(opts, None, on_step=on_step)
    return {
        "tokens": n,
        "variants": variants,
        "certificate_and_oracle": oracle,
        "step_s": sorted(steps)[len(steps) // 2],
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "kv_bytes_held": held,
    }


def count_syncs(fn) -> tuple[object, list[str]]:
    """Run fn() with CUDA's sync debug mode on: (its result, for every call that made the host wait for the device
    (a value read, a pageable copy, a value-dependent shape) its innermost Python frames, innermost last)."""
    import traceback
    import warnings

    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            frames = traceback.extract_stack()[:-1][-4:]
            sites.append(" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)))

    with warnings.catch_warnings():  # the first switch back from "warn" syncs once itself: not the decode's
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sites


def decode_syncs(model, n: int = 1024, variants: int = 8) -> dict:
    """Host synchronisations of one decode of `variants` policies, STEPS new tokens, certificate and oracle on."""
    from collections import Counter

    from kvcert.hf import DecodeOptions, Prefill, Prompt

    ids, qs = synthetic_prompt(model, n)
    opts = DecodeOptions(max_new_tokens=STEPS)
    with no_eos(model):
        batch = Prefill.record(model, Prompt(input_ids=ids, question_start=qs, example_id="gpu")).compress(
            policy_grid(variants), opts
        )
        sync("cuda")
        _, sites = count_syncs(lambda: batch.decode(opts, None))
    callers = Counter(site.split(" < ")[1] for site in sites)  # the frame below warnings.py
    return {"new_tokens": STEPS, "host_syncs": len(sites), "sites": dict(callers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("results/bench/gpu_check.json"))
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device visible; run `make gpu-check` on a machine with a GPU", file=sys.stderr)
        return 2
    if not args.skip_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py"])
        if tests.returncode != 0:
            return tests.returncode
    model, _ = load(args.model, "cuda", args.dtype)
    syncs = decode_syncs(model)
    print(
        f"[kvcert] host synchronisations in a decode of {syncs['new_tokens']} tokens: {syncs['host_syncs']} "
        f"(one per new token and one for the statistics at the end: {syncs['new_tokens'] + 1}) at {syncs['sites']}",
        flush=True,
    )
    rows = []
    for n, variants in CONFIGS:
        for oracle in (False, True):
            row = bench(model, n, variants, oracle)
            rows.append(row)
            print(
                f"[kvcert] {n} tokens, {variants} variants, certificate+oracle {'on' if oracle else 'off'}: "
                f"{row['step_s'] * 1e3:.1f} ms/step, peak {row['peak_gpu_bytes'] / 2**20:.0f} MiB, "
                f"KV held {row['kv_bytes_held'] / 2**20:.0f} MiB",
                flush=True,
            )
    from kvcert.bench.child import serving_memory, serving_ratios

    serving = []
    for n in SERVING_LENGTHS:
        for budget in SERVING_BUDGETS:
            row = dict(tokens=n, budget=budget, **serving_memory(model, "cuda", n, budget, 8))
            serving.append(row)
            print(
                f"[kvcert] serving {n} tokens, budget {budget:g}: KV held {row['kv_bytes'] / 2**20:.0f} MiB, "
                f"peak above the model {row['gpu_peak_delta_mb']:.0f} MiB",
                flush=True,
            )
    ratios = serving_ratios(serving, "gpu_peak_delta_mb")
    print(
        f"[kvcert] serving_kv_memory_ratio {ratios['kv_memory_ratio']:.3f} (target <= 0.30), "
        f"serving_peak_memory_ratio {ratios['peak_memory_ratio']:.3f} (target <= 0.5) at {ratios['tokens']} tokens"
    )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "rows": rows,
        "decode_syncs": syncs,
        "serving": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[kvcert] -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
