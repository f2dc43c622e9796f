"""Speed and memory benchmark of kvcert's decoding: ratios measured within one run, never absolute thresholds.

    python -m kvcert.bench [--quick] [--device cpu|cuda] [--dtype float32|bfloat16] [--out results/bench]

On the embedded default model (SmolLM2-135M-Instruct) with synthetic prompts (seeded random token ids, the last 40
tokens are the "question"), it measures:

1. shared prefill + batched variants (`generate_variants` with N policies) vs re-prefilling per variant (each policy
   alone: its own prefill + decode), at N = 1, 8, 24 and 1k / 2k / 4k tokens;
2. the decode-step cost of plain offset attention (certificate and oracle off) vs certificate on (oracle off) vs
   certificate + oracle, timing only the single-token decode forwards (a timing hook around
   `kvcert.hf.generate.forward_with_state`, so prefill and compression are excluded), plus the same ratio for the
   attention kernel alone;
3. cost growth with context length and variants (log-log plot);
4. peak memory per configuration (sampled peak RSS delta in a fresh subprocess on CPU,
   `torch.cuda.max_memory_allocated` on GPU);
5. thread settings (torch.set_num_threads 1 vs 2 in-process, OMP_WAIT_POLICY=PASSIVE vs default in subprocesses).

Compared configurations are interleaved (rotated order in every repetition) and summarized by medians. EOS is
disabled during the benchmark so every run decodes exactly `max_new_tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
QUESTION_TOKENS = 40
SCORERS = ("window_question", "window_context", "streaming")
DESIGNS = ("topk", "randomized")
BUDGETS = (0.25, 0.5, 0.75, 0.9)


@dataclass(frozen=True)
class BenchConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    variants: tuple[int, ...] = (1, 8, 24)
    max_new_tokens: int = 8
    prefill_reps: tuple[int, ...] = (2, 1, 1)  # repetitions per length (re-prefill at 4k is 24 full 4k prefills)
    decode_tokens: int = 1024
    decode_variants: int = 24
    decode_steps: int = 12
    decode_reps: int = 5
    attention_reps: int = 50
    thread_reps: int = 4
    omp_reps: int = 2
    memory_lengths: tuple[int, ...] = (1024, 2048, 4096)
    memory_variants: tuple[int, ...] = (1, 8, 24)
    headline_variants: int = 24
    headline_tokens: int = 1024


FULL_CONFIG = BenchConfig()
QUICK_CONFIG = BenchConfig(lengths=(1024, 2048), prefill_reps=(1, 1), decode_steps=8, decode_reps=3, attention_reps=30,
                           thread_reps=2, omp_reps=1, memory_lengths=(1024,), memory_variants=(1, 24))


# --------------------------------------------------------------------------------------------------- helpers
def policy_grid(n: int):
    """The first n of a realistic grid: budgets outer, then scorer x design (so small n still mixes them)."""
    from kvcert.hf.policy import Policy

    grid = [Policy(s, d, b) for b in BUDGETS for s in SCORERS for d in DESIGNS]
    if n > len(grid):
        grid += [Policy(s, "randomized", b, seed=k) for k in range(1, n) for b in BUDGETS for s in SCORERS]
    return grid[:n]


def synthetic_prompt(model, n: int, seed: int = 0) -> tuple[list[int], int]:
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()
    return ids, max(1, n - min(QUESTION_TOKENS, n // 2))


def load(model_name: str, device: str, dtype: str):
    from kvcert.hf import load_model, tiny_random_model

    if model_name.startswith("tiny-"):
        model, tok = tiny_random_model(model_name.removeprefix("tiny-"))
        model = model.to(device=device, dtype=getattr(torch, dtype))
        return model, tok
    return load_model(model_name, dtype=getattr(torch, dtype), device=device)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def no_eos(model):
    """Fixed-length decoding: every run decodes exactly max_new_tokens (restored afterwards)."""
    gc = getattr(model, "generation_config", None)
    old = getattr(gc, "eos_token_id", None) if gc is not None else None
    if gc is not None:
        gc.eos_token_id = None
    try:
        yield
    finally:
        if gc is not None:
            gc.eos_token_id = old


@contextmanager
def decode_timer(device):
    """Wall time of every single-token forward (= one decode step of one batch of variants) inside generate."""
    import kvcert.hf.generate as gen

    orig = gen.forward_with_state
    times: list[float] = []

    def timed(model, input_ids, positions, state):
        if input_ids.shape[1] != 1:
            return orig(model, input_ids, positions, state)
        _sync(device)
        t0 = time.perf_counter()
        out = orig(model, input_ids, positions, state)
        _sync(device)
        times.append(time.perf_counter() - t0)
        return out

    gen.forward_with_state = timed
    try:
        yield times
    finally:
        gen.forward_with_state = orig


def run_generate(model, ids, qs, policies, opts, device) -> tuple[float, float]:
    """(total seconds, decode seconds per token step for the whole variant set)."""
    from kvcert.hf.generate import generate_variants

    with decode_timer(device) as times:
        _sync(device)
        t0 = time.perf_counter()
        generate_variants(model, None, ids, qs, policies, example_id="bench", options=opts)
        _sync(device)
        total = time.perf_counter() - t0
    return total, sum(times) / opts.max_new_tokens


def _median(xs):
    return float(statistics.median(xs))


def _rotate(items, k):
    k %= len(items)
    return items[k:] + items[:k]


# ----------------------------------------------------------------------------------------------- 1. prefill
def bench_prefill(model, cfg: BenchConfig, device, log) -> list[dict]:
    """Shared prefill + batched N variants vs the sum of N solo runs (each its own prefill + decode)."""
    from kvcert.hf.generate import DecodeOptions

    opts = DecodeOptions(cfg.max_new_tokens)  # what the runner does: certificate and oracle on
    n_max = max(cfg.variants)
    grid = policy_grid(n_max)
    rows = []
    for li, n in enumerate(cfg.lengths):
        ids, qs = synthetic_prompt(model, n)
        reps = cfg.prefill_reps[min(li, len(cfg.prefill_reps) - 1)]
        run_generate(model, ids, qs, grid[:1], replace(opts, max_new_tokens=2), device)  # warm-up
        shared = {v: [] for v in cfg.variants}
        shared_step = {v: [] for v in cfg.variants}
        solo_totals: list[list[float]] = []
        for rep in range(reps):
            jobs = [("shared", v) for v in cfg.variants] + [("solo", i) for i in range(n_max)]
            solo = [0.0] * n_max
            for kind, x in _rotate(jobs, rep * 7):
                if kind == "shared":
                    total, step = run_generate(model, ids, qs, grid[:x], opts, device)
                    shared[x].append(total)
                    shared_step[x].append(step)
                else:
                    solo[x] = run_generate(model, ids, qs, [grid[x]], opts, device)[0]
            solo_totals.append(solo)
            log(f"  prefill n={n} rep {rep + 1}/{reps}: shared " + ", ".join(
                f"N={v}: {shared[v][-1]:.2f}s" for v in cfg.variants) + f"; solo sum N={n_max}: {sum(solo):.2f}s")
        for v in cfg.variants:
            re = [sum(s[:v]) for s in solo_totals]
            rows.append(dict(tokens=n, variants=v, reps=reps, shared_s=_median(shared[v]), reprefill_s=_median(re),
                             speedup=_median([r / s for r, s in zip(re, shared[v])]),
                             decode_step_s=_median(shared_step[v]),
                             solo_one_variant_s=_median([s[0] for s in solo_totals])))
    return rows


# -------------------------------------------------------------------------------------------- 2. decode step
DECODE_CONFIGS = {
    "plain": dict(certificate=False, oracle=False),
    "certificate": dict(certificate=True, oracle=False),
    "certificate+oracle": dict(certificate=True, oracle=True),
}


def bench_decode(model, cfg: BenchConfig, device, log, configs=DECODE_CONFIGS, reps=None) -> dict:
    """Per decode step (all variants advance one token), configurations interleaved in rotated order."""
    from kvcert.hf.generate import DecodeOptions

    ids, qs = synthetic_prompt(model, cfg.decode_tokens)
    policies = policy_grid(cfg.decode_variants)
    names = list(configs)
    opts = {k: DecodeOptions(cfg.decode_steps, **v) for k, v in configs.items()}
    run_generate(model, ids, qs, policies, replace(opts[names[0]], max_new_tokens=2), device)  # warm-up
    steps = {k: [] for k in names}
    for rep in range(reps or cfg.decode_reps):
        for k in _rotate(names, rep):
            steps[k].append(run_generate(model, ids, qs, policies, opts[k], device)[1])
        log(f"  decode rep {rep + 1}: " + ", ".join(f"{k} {steps[k][-1] * 1e3:.1f} ms" for k in names))
    return {k: dict(step_s=_median(v), samples_s=v) for k, v in steps.items()}


def bench_attention_only(cfg: BenchConfig, device, head_dim=64, n_kv=3, group=3) -> dict:
    """The kernel alone: hajek_attention without vs with the certificate at the decode shapes (50% kept)."""
    from kvcert.core.hajek import hajek_attention

    g = torch.Generator().manual_seed(0)
    b, m = cfg.decode_variants, cfg.decode_tokens // 2 + cfg.decode_steps
    s = m // 2
    q = torch.randn(b, n_kv, group, head_dim, generator=g).to(device)
    k = torch.randn(b, n_kv, m, head_dim, generator=g).to(device)
    v = torch.randn(b, n_kv, m, head_dim, generator=g).to(device)
    pi = torch.rand(b, n_kv, s, generator=g).clamp_min(0.05).to(device)
    off = torch.zeros(b, n_kv, m, device=device)
    off[..., :s] = -pi.log()
    omp, vsq = 1 - pi, v[..., :s, :].square().sum(-1)
    scale = head_dim**-0.5

    def once(cert):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            hajek_attention(q, k, v, off, scale=scale, one_minus_pi=omp if cert else None, variance_slots=s,
                            value_sq_norms=vsq)
        _sync(device)
        return (time.perf_counter() - t0) / 10

    once(True)
    plain, cert = [], []
    for rep in range(cfg.attention_reps):
        for c in ((False, True) if rep % 2 == 0 else (True, False)):
            (cert if c else plain).append(once(c))
    return dict(shape=dict(variants=b, kv_heads=n_kv, group=group, kept=m, tail_slots=s, head_dim=head_dim),
                plain_s=_median(plain), certificate_s=_median(cert),
                ratio=_median([c / p for c, p in zip(cert, plain)]))


# ----------------------------------------------------------------------------------------- 4/5. subprocesses
def _child_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvcert.bench", "--child", *args]


def _run_child(args: list[str], env_extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run(_child_cmd(args), capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"bench child {args} failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _rss_mb() -> float:
    """Current resident set size (Linux /proc; falls back to the max-RSS watermark elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb / 1024 if sys.platform != "darwin" else kb / 2**20


@contextmanager
def rss_peak_sampler(interval_s: float = 0.002):
    """Peak current RSS while the block runs (ru_maxrss alone is useless here: model loading sets a higher
    watermark than the run itself)."""
    import threading

    peak = [_rss_mb()]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mb())
            stop.wait(interval_s)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        yield peak
    finally:
        stop.set()
        th.join()
        peak[0] = max(peak[0], _rss_mb())


def child_memory(model_name, device, dtype, tokens, variants, max_new_tokens) -> dict:
    from kvcert.hf.generate import DecodeOptions

    torch.set_num_threads(1)  # memory does not depend on it; time does (see section 5)
    model, _ = load(model_name, device, dtype)
    ids, qs = synthetic_prompt(model, tokens)
    policies = policy_grid(variants)
    cuda = torch.device(device).type == "cuda"
    with no_eos(model):
        # the working set of a tiny warm-up run (allocator, kernels, lazily built modules) is baseline, not config
        run_generate(model, ids[: min(64, tokens)], min(qs, 32), policies[:1], DecodeOptions(2), device)
        base = _rss_mb()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_gpu = torch.cuda.memory_allocated() / 2**20
        with rss_peak_sampler() as peak:
            run_generate(model, ids, qs, policies, DecodeOptions(max_new_tokens), device)
    out = dict(rss_baseline_mb=base, rss_peak_mb=peak[0], peak_delta_mb=max(peak[0] - base, 0.0))
    if cuda:
        out["gpu_peak_delta_mb"] = torch.cuda.max_memory_allocated() / 2**20 - base_gpu
    return out


def child_decode(model_name, device, dtype, cfg: BenchConfig, threads: int) -> dict:
    torch.set_num_threads(threads)
    model, _ = load(model_name, device, dtype)
    with no_eos(model):
        res = bench_decode(model, cfg, device, lambda m: None, configs={"certificate": DECODE_CONFIGS["certificate"]})
    return dict(step_s=res["certificate"]["step_s"], threads=torch.get_num_threads())


def bench_memory(model_name, cfg: BenchConfig, device, dtype, log) -> list[dict]:
    rows = []
    for n in cfg.memory_lengths:
        for v in cfg.memory_variants:
            r = _run_child(["memory", "--model", model_name, "--device", device, "--dtype", dtype, "--tokens", str(n),
                            "--variants", str(v), "--max-new-tokens", str(cfg.max_new_tokens)])
            rows.append(dict(tokens=n, variants=v, **r))
            log(f"  memory n={n} N={v}: peak RSS delta {r['peak_delta_mb']:.0f} MB")
    return rows


def bench_threads(model, model_name, cfg: BenchConfig, device, dtype, log) -> dict:
    """set_num_threads 1 vs 2 in-process (interleaved), OMP_WAIT_POLICY PASSIVE vs default in subprocesses."""
    if torch.device(device).type != "cpu":
        return dict(note="thread settings are measured on CPU only")
    from kvcert.hf.generate import DecodeOptions

    dcfg = replace(cfg, decode_steps=max(4, cfg.decode_steps // 2))
    ids, qs = synthetic_prompt(model, dcfg.decode_tokens)
    policies = policy_grid(dcfg.decode_variants)
    opts = DecodeOptions(dcfg.decode_steps, oracle=False)
    before = torch.get_num_threads()
    counts = sorted({1, min(2, os.cpu_count() or 1), before})
    res = {c: [] for c in counts}
    try:
        for rep in range(cfg.thread_reps):
            for c in _rotate(counts, rep):
                torch.set_num_threads(c)
                res[c].append(run_generate(model, ids, qs, policies, opts, device)[1])
    finally:
        torch.set_num_threads(before)
    threads = {str(c): _median(v) for c, v in res.items()}
    best = min(threads, key=threads.get)
    log("  threads: " + ", ".join(f"{c}: {t * 1e3:.1f} ms/step" for c, t in threads.items()))
    omp: dict[str, list[float]] = {"default": [], "PASSIVE": []}
    if cfg.omp_reps > 0:
        child = ["decode", "--model", model_name, "--device", device, "--dtype", dtype, "--threads", str(max(counts)),
                 "--tokens", str(dcfg.decode_tokens), "--variants", str(dcfg.decode_variants),
                 "--steps", str(dcfg.decode_steps), "--reps", "2"]
        for rep in range(cfg.omp_reps):
            for k in _rotate(list(omp), rep):
                extra = {"OMP_WAIT_POLICY": "PASSIVE"} if k == "PASSIVE" else {}
                omp[k].append(_run_child(child, extra, drop=("OMP_WAIT_POLICY",))["step_s"])
        log("  OMP_WAIT_POLICY: " + ", ".join(f"{k}: {_median(v) * 1e3:.1f} ms/step" for k, v in omp.items()))
    omp_med = {k: _median(v) for k, v in omp.items() if v}
    return dict(num_threads_step_s=threads, best_num_threads=int(best), default_num_threads=before,
                omp_wait_policy_step_s=omp_med,
                best_omp_wait_policy=min(omp_med, key=omp_med.get) if omp_med else None,
                passive_vs_default=(omp_med["PASSIVE"] / omp_med["default"]) if len(omp_med) == 2 else None)


# -------------------------------------------------------------------------------------------------- reports
def scaling_exponents(rows: list[dict]) -> dict:
    """Log-log slopes: cost vs context length (per N) and vs variants (per length)."""

    def slope(xs, ys):
        lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
        mx, my = statistics.fmean(lx), statistics.fmean(ly)
        den = sum((a - mx) ** 2 for a in lx)
        return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den > 0 else float("nan")

    out = {}
    for key in ("shared_s", "reprefill_s", "decode_step_s"):
        by_v, by_n = {}, {}
        for r in rows:
            by_v.setdefault(r["variants"], []).append((r["tokens"], r[key]))
            by_n.setdefault(r["tokens"], []).append((r["variants"], r[key]))
        out[key] = dict(
            vs_tokens={str(v): slope(*zip(*p)) for v, p in by_v.items() if len(p) > 1},
            vs_variants={str(n): slope(*zip(*p)) for n, p in by_n.items() if len(p) > 1},
        )
    return out


def plot_scaling(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    variants = sorted({r["variants"] for r in rows})
    lengths = sorted({r["tokens"] for r in rows})
    ax = axes[0]
    for v in variants:
        pts = sorted((r["tokens"], r["shared_s"], r["reprefill_s"]) for r in rows if r["variants"] == v)
        xs = [p[0] for p in pts]
        (line,) = ax.plot(xs, [p[1] for p in pts], "o-", label=f"shared, {v} variants")
        if v > 1:
            ax.plot(xs, [p[2] for p in pts], "s--", color=line.get_color(), label=f"re-prefill, {v} variants")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="seconds per example (prefill + decode)",
           title="total cost vs context length")
    ax.legend(fontsize=7)
    ax = axes[1]
    for n in lengths:
        pts = sorted((r["variants"], r["shared_s"], r["reprefill_s"]) for r in rows if r["tokens"] == n)
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"shared, {n} tokens")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", color=line.get_color(), label=f"re-prefill, {n}")
    ax.set(xscale="log", yscale="log", xlabel="variants", ylabel="seconds per example", title="total cost vs variants")
    ax.legend(fontsize=7)
    ax = axes[2]
    for n in lengths:
        pts = sorted((r["variants"], r["decode_step_s"]) for r in rows if r["tokens"] == n)
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], "o-", label=f"{n} tokens")
    ax.set(xscale="log", yscale="log", xlabel="variants", ylabel="ms per decode step (all variants)",
           title="decode step (certificate + oracle)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_markdown(res: dict, path: Path) -> None:
    d = res["decode"]
    t = res.get("threads", {})
    lines = [
        f"# kvcert benchmark ({res['device']}, {res['dtype']})",
        "",
        f"Model `{res['model']}`, synthetic prompts (random token ids, last {QUESTION_TOKENS} = question), "
        f"{res['config']['max_new_tokens']} new tokens, EOS disabled. Mode: {'quick' if res['quick'] else 'full'}. "
        f"torch {res['env']['torch']}, {res['env']['threads']} threads, {res['env']['cpu_count']} CPUs; "
        f"run took {res['wall_s']:.0f} s. All figures are ratios measured within this one run (interleaved "
        "configurations, medians); the machine was shared with other jobs, so absolute times are noisy.",
        "",
    ]
    if torch.device(res["device"]).type == "cpu":
        lines += ["**GPU figures were not measured**: no GPU was available. The CUDA/bf16 path (`--device cuda "
                  "--dtype bfloat16`) keeps bf16 weights and runs the compressed-cache attention, certificate and "
                  "oracle in fp32; it is correct by inspection only.", ""]
    lines += [
        "## Headline",
        "",
        "| metric | value | target |",
        "|---|---|---|",
        f"| shared prefill speedup ({res['headline']['variants']} variants, {res['headline']['tokens']} tokens) | "
        f"{res['shared_prefill_speedup']:.2f}x | >= 5x |",
        f"| certificate overhead per decode step (oracle off) | {res['certificate_overhead']:.3f}x | <= 1.15x |",
        f"| certificate overhead, attention kernel alone | {res['attention_only']['ratio']:.3f}x | - |",
        f"| oracle cost (certificate + oracle vs certificate) | {res['oracle_overhead']:.3f}x | - |",
        "",
        "## 1. Shared prefill + batched variants vs re-prefilling per variant",
        "",
        "| tokens | variants | reps | shared (s) | re-prefill (s) | speedup | decode step, shared (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["prefill"]:
        lines.append(f"| {r['tokens']} | {r['variants']} | {r['reps']} | {r['shared_s']:.2f} | {r['reprefill_s']:.2f} "
                     f"| {r['speedup']:.2f}x | {r['decode_step_s'] * 1e3:.1f} |")
    dc = res["config"]
    lines += ["", f"## 2. Decode step ({dc['decode_variants']} variants, {dc['decode_tokens']} tokens, "
              f"{dc['decode_steps']} steps x {dc['decode_reps']} reps; prefill excluded)", "",
              "| configuration | ms per step | vs plain |", "|---|---|---|"]
    for k, v in d.items():
        lines.append(f"| {k} | {v['step_s'] * 1e3:.1f} | {v['step_s'] / d['plain']['step_s']:.3f}x |")
    a = res["attention_only"]
    lines += ["", f"Attention kernel alone (`hajek_attention`, shape {a['shape']}): plain {a['plain_s'] * 1e3:.3f} ms, "
              f"with certificate {a['certificate_s'] * 1e3:.3f} ms ({a['ratio']:.3f}x).", ""]
    sc = res["scaling"]
    lines += ["## 3. Scaling (log-log slopes; figure `results/figures/bench_scaling.png`)", "",
              "| cost | slope vs tokens (per variants) | slope vs variants (per tokens) |", "|---|---|---|"]
    for k, v in sc.items():
        fmt = lambda m: ", ".join(f"{a}: {b:.2f}" for a, b in m.items())  # noqa: E731
        lines.append(f"| {k} | {fmt(v['vs_tokens'])} | {fmt(v['vs_variants'])} |")
    lines += ["", "## 4. Peak memory (fresh subprocess per configuration; peak sampled RSS over a warmed-up baseline)",
              "",
              "| tokens | variants | peak delta (MB) | baseline RSS (MB) |", "|---|---|---|---|"]
    for r in res["memory"]:
        extra = f" (GPU {r['gpu_peak_delta_mb']:.0f})" if "gpu_peak_delta_mb" in r else ""
        base = r["rss_baseline_mb"]
        lines.append(f"| {r['tokens']} | {r['variants']} | {r['peak_delta_mb']:.0f}{extra} | {base:.0f} |")
    if "num_threads_step_s" in t:
        lines += ["", "## 5. Thread settings (decode step, certificate on, oracle off)", "",
                  "| setting | ms per step |", "|---|---|"]
        lines += [f"| torch.set_num_threads({c}) | {s * 1e3:.1f} |" for c, s in t["num_threads_step_s"].items()]
        omp = t["omp_wait_policy_step_s"].items()
        lines += [f"| OMP_WAIT_POLICY={k} (subprocess) | {s * 1e3:.1f} |" for k, s in omp]
        lines += ["", f"Faster: {t['best_num_threads']} thread(s); OMP_WAIT_POLICY {t['best_omp_wait_policy']}."]
    hp = res.get("hotpath")
    if hp:
        lines += ["", "## 6. Hot-path changes (state.py), before vs after, interleaved in one process", ""]
        lines += ["| configuration | before (ms/step) | after (ms/step) | after / before |", "|---|---|---|---|"]
        for k, v in hp["decode"].items():
            lines.append(f"| {k} | {v['before_s'] * 1e3:.1f} | {v['after_s'] * 1e3:.1f} | {v['ratio']:.3f} |")
        lines += ["", hp.get("note", "")]
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------------ main
def run_bench(model, model_name: str, cfg: BenchConfig, device: str, dtype: str, out_dir: Path, quick: bool,
              figure: Path | None, log=print, memory: bool = True, threads: bool = True) -> dict:
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = dict(model=model_name, device=device, dtype=dtype, quick=quick, config=asdict(cfg),
                     env=dict(torch=torch.__version__, python=platform.python_version(),
                              threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
                              omp_wait_policy=os.environ.get("OMP_WAIT_POLICY")),
                     gpu_measured=torch.device(device).type == "cuda")
    with no_eos(model):
        log("1. shared prefill vs re-prefill")
        res["prefill"] = bench_prefill(model, cfg, device, log)
        log("2. decode step")
        res["decode"] = bench_decode(model, cfg, device, log)
        res["attention_only"] = bench_attention_only(cfg, device)
        if threads:
            log("5. threads")
            res["threads"] = bench_threads(model, model_name, cfg, device, dtype, log)
    if memory:
        log("4. memory")
        res["memory"] = bench_memory(model_name, cfg, device, dtype, log)
    else:
        res["memory"] = []
    hv = cfg.headline_variants if cfg.headline_variants in cfg.variants else max(cfg.variants)
    ht = cfg.headline_tokens if cfg.headline_tokens in cfg.lengths else min(cfg.lengths)
    head = next(r for r in res["prefill"] if r["variants"] == hv and r["tokens"] == ht)
    res["headline"] = dict(variants=hv, tokens=ht)
    res["shared_prefill_speedup"] = head["speedup"]
    d = res["decode"]
    pairs = zip(d["certificate"]["samples_s"], d["plain"]["samples_s"])
    res["certificate_overhead"] = _median([c / p for c, p in pairs])
    pairs = zip(d["certificate+oracle"]["samples_s"], d["certificate"]["samples_s"])
    res["oracle_overhead"] = _median([c / p for c, p in pairs])
    res["oracle_vs_plain"] = d["certificate+oracle"]["step_s"] / d["plain"]["step_s"]
    res["scaling"] = scaling_exponents(res["prefill"])
    hp_path = out_dir / "hotpath_before_after.json"
    if hp_path.exists():
        res["hotpath"] = json.loads(hp_path.read_text())
    res["wall_s"] = time.perf_counter() - t0
    tag = torch.device(device).type
    (out_dir / f"bench_{tag}.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(res, out_dir / f"bench_{tag}.md")
    if figure is not None:
        plot_scaling(res["prefill"], figure)
    return res


# -------------------------------------------------------------------------------- integration table (issue 3)
def bench_integration(model_name: str, device: str, dtype: str, out_dir: Path, log=print) -> dict:
    """Load time (first conversion into a fresh cache, then cached), prefill at 1k and 4k tokens, and decode ms per
    step with / without the certificate and the oracle for 1 and 24 variants."""
    import tempfile

    from kvcert.hf.attention import forward_with_state, use_kvcert_attention
    from kvcert.hf.loading import load_model
    from kvcert.hf.state import KVState

    res: dict = {"device": device, "dtype": dtype, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        load_model(model_name, cache_dir=cache, dtype=getattr(torch, dtype), device=device)
        res["load_first_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, _ = load_model(model_name, cache_dir=cache, dtype=getattr(torch, dtype), device=device)
        res["load_cached_s"] = time.perf_counter() - t0
    use_kvcert_attention(model)
    res["prefill_s"] = {}
    for n in (1024, 4096):
        ids, _ = synthetic_prompt(model, n)
        times = []
        for _ in range(2):
            state = KVState(model.config.num_hidden_layers, "record")
            _sync(device)
            t0 = time.perf_counter()
            forward_with_state(model, torch.tensor([ids], device=device), torch.arange(n, device=device)[None], state)
            _sync(device)
            times.append(time.perf_counter() - t0)
        res["prefill_s"][n] = min(times)
        log(f"  prefill {n} tokens: {res['prefill_s'][n]:.2f} s")
    res["decode_ms"] = {}
    with no_eos(model):
        for variants in (1, 24):
            cfg = replace(FULL_CONFIG, decode_tokens=1024, decode_variants=variants, decode_steps=8, decode_reps=3)
            d = bench_decode(model, cfg, device, log)
            res["decode_ms"][variants] = {k: v["step_s"] * 1e3 for k, v in d.items()}
    lines = ["| measurement | value |", "|---|---|",
             f"| load, first (GGUF dequantize + convert to safetensors) | {res['load_first_s']:.1f} s |",
             f"| load, cached safetensors | {res['load_cached_s']:.1f} s |"]
    lines += [f"| prefill, {n} tokens (exact attention, records the oracle) | {t:.2f} s |"
              for n, t in res["prefill_s"].items()]
    for variants, d in res["decode_ms"].items():
        lines.append(f"| decode step, {variants} variant(s), 1k tokens: plain / + certificate / + oracle | "
                     f"{d['plain']:.0f} / {d['certificate']:.0f} / {d['certificate+oracle']:.0f} ms |")
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = torch.device(device).type
    (out_dir / f"integration_{tag}.json").write_text(json.dumps(res, indent=2) + "\n")
    (out_dir / f"integration_{tag}.md").write_text(
        f"# kvcert inside transformers ({tag}, {dtype}, {res['threads']} threads)\n\n" + "\n".join(lines) + "\n")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcert.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer lengths and repetitions (about 5-8 minutes on CPU)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="weights dtype (default float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--figure", default="results/figures/bench_scaling.png")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, choices=["memory", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--variants", type=int, default=24, help=argparse.SUPPRESS)
    ap.add_argument("--max-new-tokens", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default 1, see section 5)")
    ap.add_argument("--integration", action="store_true",
                    help="only the load / prefill / decode-step table of the HF integration")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False (CPU-only torch build or no GPU)",
              file=sys.stderr)
        return 2
    if args.child == "memory":
        r = child_memory(args.model, args.device, dtype, args.tokens, args.variants, args.max_new_tokens)
        print(json.dumps(r))
        return 0
    if args.child == "decode":
        cfg = replace(FULL_CONFIG, decode_tokens=args.tokens, decode_variants=args.variants,
                      decode_steps=args.steps, decode_reps=args.reps)
        print(json.dumps(child_decode(args.model, args.device, dtype, cfg, args.threads or torch.get_num_threads())))
        return 0
    cfg = QUICK_CONFIG if args.quick else FULL_CONFIG
    if args.device == "cpu":  # 1 thread by default: on a shared 2-core machine 2 spinning OpenMP threads lose badly
        torch.set_num_threads(args.threads or 1)
    if args.integration:
        bench_integration(args.model, args.device, dtype, Path(args.out), log=lambda m: print(m, flush=True))
        print((Path(args.out) / f"integration_{torch.device(args.device).type}.md").read_text())
        return 0
    model, _ = load(args.model, args.device, dtype)
    res = run_bench(model, args.model, cfg, args.device, dtype, Path(args.out), args.quick, Path(args.figure),
                    log=lambda m: print(m, flush=True))
    print(f"shared_prefill_speedup {res['shared_prefill_speedup']:.2f}x, certificate_overhead "
          f"{res['certificate_overhead']:.3f}x, oracle_overhead {res['oracle_overhead']:.3f}x -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
