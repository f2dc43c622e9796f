"""Speed, memory and roofline benchmark of kvcert's decoding -> results/bench/bench_<device>.{json,md} + figures.

`run_bench` runs a profile on a loaded model; `main` is `python -m kvcert.bench`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from kvcert.bench.child import bench_threads
from kvcert.bench.common import DEFAULT_MODEL, FULL_CONFIG, QUICK_CONFIG, BenchConfig, load, median, no_eos, sync
from kvcert.bench.figures import plot_roofline, plot_scaling
from kvcert.bench.measure import bench_attention_only, bench_decode, bench_examples, bench_prefill
from kvcert.bench.report import md_table, scaling_exponents, write_markdown
from kvcert.bench.roofline import bench_roofline

HEADLINE_CONFIG = "certificate+oracle"  # what the runner decodes with (`DecodeOptions()`)
TORCH_OPS_CONFIG = "certificate+oracle, torch ops"  # the same without the compiled CPU kernel


def run_bench(
    model,
    model_name: str,
    cfg: BenchConfig,
    device: str,
    dtype: str,
    out_dir: Path,
    quick: bool,
    figure: Path | None,
    log=print,
    memory: bool = True,
    threads: bool = True,
    versus: bool = True,
    tokenizer=None,
    roofline_figure: Path | None = None,
) -> dict:
    from kvcert.bench.child import bench_memory, bench_serving

    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = dict(
        model=model_name,
        device=device,
        dtype=dtype,
        quick=quick,
        config=asdict(cfg),
        env=dict(
            torch=torch.__version__,
            python=platform.python_version(),
            threads=torch.get_num_threads(),
            cpu_count=os.cpu_count(),
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        ),
        gpu_measured=torch.device(device).type == "cuda",
    )
    with no_eos(model):
        log("1. shared prefill vs re-prefill")
        res["prefill"] = bench_prefill(model, cfg, device, log)
        log("2. decode step")
        res["decode"] = bench_decode(model, cfg, device, log)
        res["attention_only"] = bench_attention_only(cfg, device)
        log("7. roofline")
        res["roofline"] = bench_roofline(model, cfg, device, log)
        if threads:
            log("5. threads")
            res["threads"] = bench_threads(model, model_name, cfg, device, dtype, log)
    log("6. confirmatory examples, before vs after")  # EOS and stop strings on: a real run
    res["examples"] = bench_examples(model, tokenizer, cfg, device, log)
    if memory:
        log("4. memory")
        res["memory"] = bench_memory(model_name, cfg, device, dtype, log)
        log("4b. serving memory")
        res["serving"] = bench_serving(model_name, cfg, device, dtype, log)
        res["serving_kv_memory_ratio"] = res["serving"]["kv_memory_ratio"]
        res["serving_peak_memory_ratio"] = res["serving"]["peak_memory_ratio"]
    else:
        res["memory"] = []
    hv = cfg.headline_variants if cfg.headline_variants in cfg.variants else max(cfg.variants)
    ht = cfg.headline_tokens if cfg.headline_tokens in cfg.lengths else min(cfg.lengths)
    head = next(r for r in res["prefill"] if r["variants"] == hv and r["tokens"] == ht)
    res["headline"] = dict(variants=hv, tokens=ht)
    res["shared_prefill_speedup"] = head["speedup"]
    d = res["decode"]

    def ratio(num: str, den: str) -> float:  # per repetition (configurations interleaved), then the median
        return median([c / p for c, p in zip(d[num]["samples_s"], d[den]["samples_s"])])

    # the headline: the whole certificate (V_hat, diagnostics, tr(C^2) every step) vs plain, the same engine
    res["certificate_overhead"] = ratio("certificate", "plain")
    res["certificate_overhead_torch_ops"] = ratio("certificate, torch ops", "plain, torch ops")
    for key, config in (
        ("certificate_overhead_no_tight", "certificate, no tight radius"),
        ("certificate_overhead_tight_every8", "certificate, tight radius every 8"),
    ):
        res[key] = ratio(config, "plain")
    res["kernel_speedup"] = ratio("certificate+oracle, torch ops", "certificate+oracle")
    res["oracle_overhead"] = ratio("certificate+oracle", "certificate")
    res["oracle_vs_plain"] = d["certificate+oracle"]["step_s"] / d["plain"]["step_s"]
    res["scaling"] = scaling_exponents(res["prefill"])
    rows = res["roofline"]["rows"]
    rv = cfg.headline_variants if cfg.headline_variants in cfg.roofline_variants else max(cfg.roofline_variants)
    rt = cfg.headline_tokens if cfg.headline_tokens in cfg.roofline_lengths else min(cfg.roofline_lengths)
    rh = next(r for r in rows if r["variants"] == rv and r["tokens"] == rt and r["config"] == HEADLINE_CONFIG)
    res["roofline_headline"] = dict(
        variants=rv, tokens=rt, config=HEADLINE_CONFIG, step_s=rh["step_s"], limit_s=rh["limit_s"], bound=rh["bound"]
    )
    res["roofline_multiple"] = rh["multiple"]
    rd = next(r for r in rows if r["variants"] == rv and r["tokens"] == rt and r["config"] == TORCH_OPS_CONFIG)
    res["roofline_multiple_torch_ops"] = rd["multiple"]
    res["example_speedup"] = res["examples"]["example_speedup"]
    if versus:
        from kvcert.bench import versus as before_after

        log("8. before / after: this engine vs the earlier fast path, and kvpress's protocol (fresh processes)")
        try:
            vs = before_after.run(
                reps=1 if quick else 2, model=model_name, threads=torch.get_num_threads(), quick=quick, log=log
            )
        except RuntimeError as err:  # no git history (an installed package): say so, keep the rest of the run
            log(f"  skipped: {err}")
            vs = None
        res["versus"] = vs
        if vs is not None:
            res["engine_vs_fast_path"] = {r["configuration"]: r["ratio"] for r in vs["rows"]}
            res["kvpress_protocol_s_per_example"] = vs["kvpress_protocol_s_per_example"]
            (out_dir / "engine_vs_fast_path.md").write_text(before_after.markdown(vs))
            (out_dir / "engine_vs_fast_path.json").write_text(json.dumps(vs, indent=2) + "\n")
    res["wall_s"] = time.perf_counter() - t0
    tag = torch.device(device).type
    (out_dir / f"bench_{tag}.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(res, out_dir / f"bench_{tag}.md")
    if figure is not None:
        plot_scaling(res["prefill"], figure)
        plot_roofline(res["roofline"], roofline_figure or figure.with_name("bench_roofline.png"))
    return res


def bench_integration(model_name: str, device: str, dtype: str, out_dir: Path, log=print) -> dict:
    """Load time (first conversion into a fresh cache, then cached), prefill at 1k and 4k tokens, and decode ms per
    step with / without the certificate and the oracle for 1 and 24 variants."""
    import tempfile

    from kvcert.bench.common import synthetic_prompt
    from kvcert.hf.attention import RecordState, forward_with_state, kvcert_attention_on
    from kvcert.hf.loading import load_model

    res: dict = {"device": device, "dtype": dtype, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        load_model(model_name, cache_dir=cache, dtype=getattr(torch, dtype), device=device)
        res["load_first_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, _ = load_model(model_name, cache_dir=cache, dtype=getattr(torch, dtype), device=device)
        res["load_cached_s"] = time.perf_counter() - t0
    res["prefill_s"] = {}
    for n in (1024, 4096):
        ids, _ = synthetic_prompt(model, n)
        times = []
        for _ in range(2):
            state = RecordState(model.config.num_hidden_layers)
            sync(device)
            t0 = time.perf_counter()
            with kvcert_attention_on(model):
                forward_with_state(model, torch.tensor([ids], device=device), 0, state)
            sync(device)
            times.append(time.perf_counter() - t0)
        res["prefill_s"][n] = min(times)
        log(f"  prefill {n} tokens: {res['prefill_s'][n]:.2f} s")
    res["decode_ms"] = {}
    with no_eos(model):
        for variants in (1, 24):
            cfg = replace(FULL_CONFIG, decode_tokens=1024, decode_variants=variants, decode_steps=8, decode_reps=3)
            d = bench_decode(model, cfg, device, log)
            res["decode_ms"][variants] = {k: v["step_s"] * 1e3 for k, v in d.items()}
    rows = [
        ["load, first (GGUF dequantize + convert to safetensors)", f"{res['load_first_s']:.1f} s"],
        ["load, cached safetensors", f"{res['load_cached_s']:.1f} s"],
    ]
    rows += [
        [f"prefill, {n} tokens (exact attention, records the oracle)", f"{t:.2f} s"]
        for n, t in res["prefill_s"].items()
    ]
    for variants, d in res["decode_ms"].items():
        rows.append(
            [
                f"decode step, {variants} variant(s), 1k tokens: plain / + certificate / + oracle",
                f"{d['plain']:.0f} / {d['certificate']:.0f} / {d['certificate+oracle']:.0f} ms",
            ]
        )
    lines = md_table(["measurement", "value"], rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = torch.device(device).type
    (out_dir / f"integration_{tag}.json").write_text(json.dumps(res, indent=2) + "\n")
    (out_dir / f"integration_{tag}.md").write_text(
        f"# kvcert inside transformers ({tag}, {dtype}, {res['threads']} threads)\n\n" + "\n".join(lines) + "\n"
    )
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcert.bench", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1k tokens, fewer repetitions (a few minutes on a quiet CPU)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights dtype (default float32 on CPU, bfloat16 on CUDA)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="default results/bench (full) or results/bench/quick (--quick: never overwrites the full one)",
    )
    ap.add_argument(
        "--figure",
        default=None,
        help="scaling figure (default results/figures/bench_scaling.png, "
        "--quick: <out>/bench_scaling.png); the roofline figure goes beside it as bench_roofline.png",
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default 1, see section 5)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument(
        "--no-versus", action="store_true", help="skip section 8 (the earlier engine, exported from git history)"
    )
    ap.add_argument(
        "--integration", action="store_true", help="only the load / prefill / decode-step table of the HF integration"
    )
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but torch.cuda.is_available() is False (CPU-only torch build or no GPU)",
            file=sys.stderr,
        )
        return 2
    cfg = QUICK_CONFIG if args.quick else FULL_CONFIG
    args.out = args.out or ("results/bench/quick" if args.quick else "results/bench")
    default_figure = f"{args.out}/bench_scaling.png" if args.quick else "results/figures/bench_scaling.png"
    args.figure = args.figure or default_figure
    if args.device == "cpu":  # 1 thread by default: on a shared 2-core machine 2 spinning OpenMP threads lose badly
        torch.set_num_threads(args.threads or 1)
    if args.integration:
        bench_integration(args.model, args.device, dtype, Path(args.out), log=lambda m: print(m, flush=True))
        print((Path(args.out) / f"integration_{torch.device(args.device).type}.md").read_text())
        return 0
    if args.device == "cpu":  # the compiled backend's kernel: build it now, or say why it cannot be
        from kvcert.hf import kernel

        try:
            kernel.kernel()
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    model, tok = load(args.model, args.device, dtype)
    res = run_bench(
        model,
        args.model,
        cfg,
        args.device,
        dtype,
        Path(args.out),
        args.quick,
        Path(args.figure),
        log=lambda m: print(m, flush=True),
        memory=not args.no_memory,
        versus=not args.no_versus,
        tokenizer=tok,
    )
    sp = res["example_speedup"]
    print(
        f"shared_prefill_speedup {res['shared_prefill_speedup']:.2f}x, certificate_overhead "
        f"{res['certificate_overhead']:.3f}x, roofline_multiple {res['roofline_multiple']:.1f}x, example_speedup "
        f"{'n/a' if sp is None else f'{sp:.2f}x'} -> {args.out}"
    )
    return 0
