"""The child-process protocol: measurements that need a fresh process (peak memory over a clean baseline, the
OMP_WAIT_POLICY environment) run as

    python -m kvcert.bench.child {memory|serving|decode} --model ... [--tokens --variants --budget --max-new-tokens
        --steps --reps]

with kvcert's src on PYTHONPATH; the child prints one JSON object as the last line of stdout and exits 0, or exits
non-zero with the error on stderr (the parent raises with its last line)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from kvcert.bench.common import (
    FULL_CONFIG,
    load,
    median,
    no_eos,
    policy_grid,
    rotate,
    run_generate,
    synthetic_prompt,
)
from kvcert.bench.measure import DECODE_CONFIGS, bench_decode
from kvcert.serve.generate import kv_bytes


def run_child(
    args: list[str], env_extra: dict[str, str] | None = None, drop: tuple[str, ...] = (), timeout: float = 1800
) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run(
        [sys.executable, "-m", "kvcert.bench.child", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    if res.returncode != 0:
        raise RuntimeError(f"bench child {args} failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def rss_mb() -> float:
    """Current resident set size (Linux /proc; falls back to the max-RSS watermark elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the OS (glibc malloc_trim), so that the RSS baseline is what is alive,
    not what model loading once used; a no-op where there is no glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# large blocks straight from mmap, so freed memory leaves the RSS at once (glibc; ignored elsewhere)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@contextmanager
def rss_peak_sampler(interval_s: float = 0.002):
    """Peak current RSS while the block runs (ru_maxrss alone is useless here: model loading sets a higher
    watermark than the run itself)."""
    peak = [rss_mb()]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb())
            stop.wait(interval_s)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        yield peak
    finally:
        stop.set()
        th.join()
        peak[0] = max(peak[0], rss_mb())


def child_memory(model_name, device, dtype, tokens, variants, max_new_tokens) -> dict:
    from kvcert.hf import DecodeOptions

    torch.set_num_threads(1)  # memory does not depend on it; time does (see section 5)
    model, _ = load(model_name, device, dtype)
    ids, qs = synthetic_prompt(model, tokens)
    policies = policy_grid(variants)
    cuda = torch.device(device).type == "cuda"
    with no_eos(model):
        # the working set of a tiny warm-up run (allocator, kernels, lazily built modules) is baseline, not config
        run_generate(model, ids[: min(64, tokens)], min(qs, 32), policies[:1], DecodeOptions(max_new_tokens=2), device)
        base = rss_mb()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_gpu = torch.cuda.memory_allocated() / 2**20
        with rss_peak_sampler() as peak:
            run_generate(model, ids, qs, policies, DecodeOptions(max_new_tokens=max_new_tokens), device)
    out = dict(rss_baseline_mb=base, rss_peak_mb=peak[0], peak_delta_mb=max(peak[0] - base, 0.0))
    if cuda:
        out["gpu_peak_delta_mb"] = torch.cuda.max_memory_allocated() / 2**20 - base_gpu
    return out


def serving_memory(model, device: str, tokens: int, budget: float, max_new_tokens: int) -> dict:
    """Serving mode (oracle off, certificate on) for one policy: window_question x randomized at `budget`, or the
    full cache (budget 1): peak memory of prefill + compression + decoding above the loaded, warmed-up model (CPU:
    sampled RSS; CUDA: torch.cuda.max_memory_allocated), and the KV bytes the compressed caches hold."""
    from kvcert.hf import FULL, DecodeOptions, Policy, Prompt, compress_while_reading

    ids, qs = synthetic_prompt(model, tokens)
    policy = FULL if budget >= 1 else Policy(scorer="window_question", design="randomized", budget=budget)
    opts = DecodeOptions(max_new_tokens=max_new_tokens, oracle=False, certificate=True)
    cuda = torch.device(device).type == "cuda"
    with no_eos(model):
        warm = Prompt(input_ids=ids[:64], question_start=32, example_id="warm")
        compress_while_reading(model, warm, [policy], opts).decode(opts)
        release_free_memory()
        base = rss_mb()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_gpu = torch.cuda.memory_allocated()
        with rss_peak_sampler() as peak:
            prompt = Prompt(input_ids=ids, question_start=qs, example_id="serving")
            batch = compress_while_reading(model, prompt, [policy], opts)
            held = kv_bytes(batch)
            batch.decode(opts)
            del batch
    out = dict(rss_baseline_mb=base, rss_peak_mb=peak[0], peak_delta_mb=max(peak[0] - base, 0.0), kv_bytes=held)
    if cuda:
        torch.cuda.synchronize()
        out["gpu_peak_delta_mb"] = (torch.cuda.max_memory_allocated() - base_gpu) / 2**20
    return out


def child_serving(model_name, device, dtype, tokens, budget, max_new_tokens) -> dict:
    torch.set_num_threads(1)
    model, _ = load(model_name, device, dtype)
    return serving_memory(model, device, tokens, budget, max_new_tokens)


def serving_ratios(rows: list[dict], peak_key: str) -> dict:
    """The two targets at the longest prompt: KV bytes held and peak memory, budget 0.25 over the full cache."""
    n = max(r["tokens"] for r in rows)
    at = {r["budget"]: r for r in rows if r["tokens"] == n}
    full, quarter = at[1.0], at[0.25]
    return dict(
        rows=rows,
        tokens=n,
        peak=peak_key,
        kv_memory_ratio=quarter["kv_bytes"] / full["kv_bytes"],
        peak_memory_ratio=quarter[peak_key] / full[peak_key],
    )


def bench_serving(model_name, cfg, device, dtype, log) -> dict:
    """Serving mode's memory: one policy at each budget against the full cache, per prompt length, each in a fresh
    process; the two ratios at the longest length."""
    rows = []
    for n in cfg.serving_lengths:
        for budget in cfg.serving_budgets:
            args = ["serving", "--model", model_name, "--device", device, "--dtype", dtype]
            args += ["--tokens", str(n), "--budget", str(budget), "--max-new-tokens", str(cfg.max_new_tokens)]
            r = run_child(args, env_extra=MALLOC_ENV)
            rows.append(dict(tokens=n, budget=budget, **r))
            log(
                f"  serving n={n} budget={budget:g}: KV held {r['kv_bytes'] / 2**20:.0f} MiB, "
                f"peak above the model {r['peak_delta_mb']:.0f} MB"
            )
    peak_key = "gpu_peak_delta_mb" if torch.device(device).type == "cuda" else "peak_delta_mb"
    return serving_ratios(rows, peak_key)


def child_decode(model_name, device, dtype, cfg, threads: int) -> dict:
    torch.set_num_threads(threads)
    model, _ = load(model_name, device, dtype)
    with no_eos(model):
        res = bench_decode(model, cfg, device, lambda m: None, configs={"certificate": DECODE_CONFIGS["certificate"]})
    return dict(step_s=res["certificate"]["step_s"], threads=torch.get_num_threads())


def bench_memory(model_name, cfg, device, dtype, log) -> list[dict]:
    rows = []
    for n in cfg.memory_lengths:
        for v in cfg.memory_variants:
            r = run_child(
                [
                    "memory",
                    "--model",
                    model_name,
                    "--device",
                    device,
                    "--dtype",
                    dtype,
                    "--tokens",
                    str(n),
                    "--variants",
                    str(v),
                    "--max-new-tokens",
                    str(cfg.max_new_tokens),
                ]
            )
            rows.append(dict(tokens=n, variants=v, **r))
            log(f"  memory n={n} N={v}: peak RSS delta {r['peak_delta_mb']:.0f} MB")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcert.bench.child")
    ap.add_argument("kind", choices=["memory", "serving", "decode"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--variants", type=int, default=24)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.kind == "memory":
        r = child_memory(a.model, a.device, a.dtype, a.tokens, a.variants, a.max_new_tokens)
    elif a.kind == "serving":
        r = child_serving(a.model, a.device, a.dtype, a.tokens, a.budget, a.max_new_tokens)
    else:
        cfg = replace(
            FULL_CONFIG, decode_tokens=a.tokens, decode_variants=a.variants, decode_steps=a.steps, decode_reps=a.reps
        )
        r = child_decode(a.model, a.device, a.dtype, cfg, a.threads or torch.get_num_threads())
    print(json.dumps(r))
    return 0


# ----------------------------------------------------------------------------------------------- 5. threads
def bench_threads(model, model_name, cfg, device, dtype, log) -> dict:
    """set_num_threads 1 vs 2 in-process (interleaved), OMP_WAIT_POLICY PASSIVE vs default in subprocesses."""
    if torch.device(device).type != "cpu":
        return dict(note="thread settings are measured on CPU only")
    from kvcert.hf import DecodeOptions

    dcfg = replace(cfg, decode_steps=max(4, cfg.decode_steps // 2))
    ids, qs = synthetic_prompt(model, dcfg.decode_tokens)
    policies = policy_grid(dcfg.decode_variants)
    opts = DecodeOptions(max_new_tokens=dcfg.decode_steps, oracle=False)
    before = torch.get_num_threads()
    counts = sorted({1, min(2, os.cpu_count() or 1), before})
    res = {c: [] for c in counts}
    try:
        for rep in range(cfg.thread_reps):
            for c in rotate(counts, rep):
                torch.set_num_threads(c)
                res[c].append(run_generate(model, ids, qs, policies, opts, device)[1])
    finally:
        torch.set_num_threads(before)
    threads = {str(c): median(v) for c, v in res.items()}
    best = min(threads, key=threads.get)
    log("  threads: " + ", ".join(f"{c}: {t * 1e3:.1f} ms/step" for c, t in threads.items()))
    omp: dict[str, list[float]] = {"default": [], "PASSIVE": []}
    if cfg.omp_reps > 0:
        child = [
            "decode",
            "--model",
            model_name,
            "--device",
            device,
            "--dtype",
            dtype,
            "--threads",
            str(max(counts)),
            "--tokens",
            str(dcfg.decode_tokens),
            "--variants",
            str(dcfg.decode_variants),
            "--steps",
            str(dcfg.decode_steps),
            "--reps",
            "2",
        ]
        for rep in range(cfg.omp_reps):
            for k in rotate(list(omp), rep):
                extra = {"OMP_WAIT_POLICY": "PASSIVE"} if k == "PASSIVE" else {}
                omp[k].append(run_child(child, extra, drop=("OMP_WAIT_POLICY",))["step_s"])
        log("  OMP_WAIT_POLICY: " + ", ".join(f"{k}: {median(v) * 1e3:.1f} ms/step" for k, v in omp.items()))
    omp_med = {k: median(v) for k, v in omp.items() if v}
    return dict(
        num_threads_step_s=threads,
        best_num_threads=int(best),
        default_num_threads=before,
        omp_wait_policy_step_s=omp_med,
        best_omp_wait_policy=min(omp_med, key=omp_med.get) if omp_med else None,
        passive_vs_default=(omp_med["PASSIVE"] / omp_med["default"]) if len(omp_med) == 2 else None,
    )


if __name__ == "__main__":
    raise SystemExit(main())
