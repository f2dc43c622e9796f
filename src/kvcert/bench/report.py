"""Reports: log-log scaling slopes and the markdown summary (the figures: kvcert.bench.figures)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pandas as pd
import torch

from kvcert.analysis.tables import markdown_table
from kvcert.bench.common import QUESTION_TOKENS


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


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines (kvcert.analysis.tables.markdown_table), every cell written as given."""
    return markdown_table(pd.DataFrame(rows, columns=header), parse_numbers=False).split("\n")


def _fmt(x, spec=".2f", suffix=""):
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:{spec}}{suffix}"


def write_markdown(res: dict, path: Path) -> None:
    d = res["decode"]
    t = res.get("threads", {})
    ex = res.get("examples") or {}
    lines = [
        f"# kvcert benchmark ({res['device']}, {res['dtype']})",
        "",
        f"Model `{res['model']}`, synthetic prompts (random token ids, last {QUESTION_TOKENS} = question) for "
        f"sections 1-5, {res['config']['max_new_tokens']} new tokens, EOS disabled there. Mode: "
        f"{'quick' if res['quick'] else 'full'}. torch {res['env']['torch']}, {res['env']['threads']} threads, "
        f"{res['env']['cpu_count']} CPUs; run took {res['wall_s']:.0f} s. Ratios are measured within this one run "
        "(interleaved configurations, medians); on a shared machine absolute times are noisy.",
        "",
    ]
    if torch.device(res["device"]).type == "cpu":
        lines += [
            "GPU figures are `make gpu-check`'s (results/bench/gpu/): on CUDA the engine runs on torch ops (the "
            "compiled backend is a CPU kernel), bf16 caches with float32 math.",
            "",
        ]
    roof = res.get("roofline") or {}
    rl = res.get("roofline_headline") or {}
    exb, exa = ex.get("before") or {}, ex.get("after") or {}
    headline = [
        [
            f"shared prefill speedup ({res['headline']['variants']} variants, {res['headline']['tokens']} tokens)",
            f"{res['shared_prefill_speedup']:.2f}x",
            ">= 5x",
        ],
        [
            "certificate overhead per decode step (oracle off; `DecodeOptions()`, compiled backend on a CPU) vs plain",
            f"{res['certificate_overhead']:.3f}x",
            "<= 1.15x",
        ],
        ["... V_hat + diagnostics, no tight radius", _fmt(res.get("certificate_overhead_no_tight"), ".3f", "x"), "-"],
        [
            "... tight radius refreshed every 8th step (`decode.tight_radius_every=8`)",
            _fmt(res.get("certificate_overhead_tight_every8"), ".3f", "x"),
            "-",
        ],
        [
            "... on the torch-ops backend (`decode.backend=torch`, what a GPU runs)",
            _fmt(res.get("certificate_overhead_torch_ops"), ".3f", "x"),
            "-",
        ],
        [
            "compiled kernel's gain (certificate + oracle step, torch-ops backend / compiled backend)",
            _fmt(res.get("kernel_speedup"), ".2f", "x"),
            "-",
        ],
        ["certificate overhead, attention kernel alone", f"{res['attention_only']['ratio']:.3f}x", "-"],
        ["oracle cost (certificate + oracle vs certificate)", f"{res['oracle_overhead']:.3f}x", "-"],
        [
            f"roofline multiple: decode step / machine limit ({rl.get('variants', '-')} variants, "
            f"{rl.get('tokens', '-')} tokens, {rl.get('config', '-')})",
            _fmt(res.get("roofline_multiple"), ".1f", "x"),
            "<= 2.5x",
        ],
        ["... the same on the torch-ops backend", _fmt(res.get("roofline_multiple_torch_ops"), ".1f", "x"), "-"],
        [
            f"seconds per confirmatory example ({ex.get('variants', '-')} variants), before / after",
            f"{_fmt(exb.get('seconds_per_example'))} / {_fmt(exa.get('seconds_per_example'))} s",
            "-",
        ],
        [
            "examples per hour, before / after",
            f"{_fmt(exb.get('examples_per_hour'), '.0f')} / {_fmt(exa.get('examples_per_hour'), '.0f')}",
            "-",
        ],
        ["example speedup (before / after, one run)", _fmt(res.get("example_speedup"), ".2f", "x"), "-"],
        *[
            [f"this engine vs the earlier fast path, {name} (earlier / this, section 8)", f"{ratio:.2f}x", ">= 1x"]
            for name, ratio in (res.get("engine_vs_fast_path") or {}).items()
        ],
        [
            "kvpress protocol, seconds per example (11 configurations, 1k tokens, 16 new tokens)",
            f"{_fmt(res.get('kvpress_protocol_s_per_example'), '.2f')} s",
            "-",
        ],
    ]
    prefill = [
        [
            f"{r['tokens']}",
            f"{r['variants']}",
            f"{r['reps']}",
            f"{r['shared_s']:.2f}",
            f"{r['reprefill_s']:.2f}",
            f"{r['speedup']:.2f}x",
            f"{r['decode_step_s'] * 1e3:.1f}",
        ]
        for r in res["prefill"]
    ]
    lines += [
        "## Headline",
        "",
        *md_table(["metric", "value", "target"], headline),
        "",
        "## 1. Shared prefill + batched variants vs re-prefilling per variant",
        "",
        *md_table(
            ["tokens", "variants", "reps", "shared (s)", "re-prefill (s)", "speedup", "decode step, shared (ms)"],
            prefill,
        ),
    ]
    lines += [
        "",
        "With one variant, shared and re-prefilled are the same work (one prefill, one policy): that row's ratio is "
        "an A/A check of this run's timing noise, not a speed-up.",
    ]
    dc = res["config"]
    lines += [
        "",
        f"## 2. Decode step ({dc['decode_variants']} variants, {dc['decode_tokens']} tokens, "
        f"{dc['decode_steps']} steps x {dc['decode_reps']} reps; prefill excluded; step = interval between "
        "consecutive `on_step` callbacks)",
        "",
        *md_table(
            ["configuration", "ms per step", "vs plain"],
            [[k, f"{v['step_s'] * 1e3:.1f}", f"{v['step_s'] / d['plain']['step_s']:.3f}x"] for k, v in d.items()],
        ),
    ]
    a = res["attention_only"]
    lines += [
        "",
        f"Attention kernel alone (`hajek_attention`, shape {a['shape']}): plain {a['plain_s'] * 1e3:.3f} ms, "
        f"with certificate {a['certificate_s'] * 1e3:.3f} ms ({a['ratio']:.3f}x).",
        "",
    ]
    sc = res["scaling"]
    lines += [
        "## 3. Scaling (log-log slopes; figure `bench_scaling.png`)",
        "",
    ]
    fmt = lambda m: ", ".join(f"{a}: {b:.2f}" for a, b in m.items()) or "-"  # noqa: E731
    lines += md_table(
        ["cost", "slope vs tokens (per variants)", "slope vs variants (per tokens)"],
        [[k, fmt(v["vs_tokens"]), fmt(v["vs_variants"])] for k, v in sc.items()],
    )
    lines += [
        "",
        "## 4. Peak memory (fresh subprocess per configuration; peak sampled RSS over a warmed-up baseline)",
        "",
    ]
    memory = []
    for r in res["memory"]:
        extra = f" (GPU {r['gpu_peak_delta_mb']:.0f})" if "gpu_peak_delta_mb" in r else ""
        memory.append(
            [f"{r['tokens']}", f"{r['variants']}", f"{r['peak_delta_mb']:.0f}{extra}", f"{r['rss_baseline_mb']:.0f}"]
        )
    lines += md_table(["tokens", "variants", "peak delta (MB)", "baseline RSS (MB)"], memory)
    sv = res.get("serving")
    if sv:
        lines += [
            "",
            "## 4b. Serving mode: one policy (window_question x randomized), oracle off, against the full cache",
            "",
            "Each layer is compressed inside its prefill forward; KV held = the compressed caches' keys and values",
            "(padding and the slots of the tokens to come included); peak = above the loaded, warmed-up model.",
            "",
            *md_table(
                ["tokens", "budget", "KV held (MiB)", "peak (MB)"],
                [
                    [f"{r['tokens']}", f"{r['budget']:g}", f"{r['kv_bytes'] / 2**20:.0f}", f"{r[sv['peak']]:.0f}"]
                    for r in sv["rows"]
                ],
            ),
        ]
        lines += [
            "",
            f"At {sv['tokens']} tokens: serving_kv_memory_ratio {sv['kv_memory_ratio']:.3f} (target <= 0.30), "
            f"serving_peak_memory_ratio {sv['peak_memory_ratio']:.3f} (target <= 0.5).",
        ]
    if "num_threads_step_s" in t:
        lines += [
            "",
            "## 5. Thread settings (decode step, certificate on, oracle off)",
            "",
        ]
        settings = [[f"torch.set_num_threads({c})", f"{s * 1e3:.1f}"] for c, s in t["num_threads_step_s"].items()]
        settings += [
            [f"OMP_WAIT_POLICY={k} (subprocess)", f"{s * 1e3:.1f}"] for k, s in t["omp_wait_policy_step_s"].items()
        ]
        lines += md_table(["setting", "ms per step"], settings)
        best_omp = f"; OMP_WAIT_POLICY {t['best_omp_wait_policy']}" if t.get("best_omp_wait_policy") else ""
        lines += ["", f"Faster: {t['best_num_threads']} thread(s){best_omp}."]
    if ex:
        lines += [
            "",
            f"## 6. End to end: confirmatory examples, before vs after ({ex['variants']} variants, tasks "
            f"{', '.join(ex['tasks'])}, prompt tokens {ex['lengths']}, {ex['examples']} examples x "
            f"{ex['reps']} rep(s), interleaved)",
            "",
            "Before = the decode engine on torch ops (`decode.backend=torch`); after = on the compiled CPU kernel "
            "(`decode.backend=compiled`). "
            "Seconds per example = prefill + compression + decode of all variants with "
            "certificate and oracle, EOS and stop strings on (model load excluded).",
            "",
            *md_table(
                ["mode", "seconds per example", "examples per hour"],
                [
                    [k, _fmt(v and v["seconds_per_example"]), _fmt(v and v["examples_per_hour"], ".0f")]
                    for k, v in ((k, ex.get(k)) for k in ("before", "after"))
                ],
            ),
        ]
        if not ex.get("available_after"):
            lines += [
                "",
                "'after' is n/a: the decode engine has no speed switches left to toggle; compare with the earlier "
                "two-path engine at its commit (docs/performance.md).",
            ]
        elif ex.get("answers_identical") is not None:
            lines += ["", f"Answers identical before vs after: {ex['answers_identical']:.1%} of variants."]
    if roof:
        m = roof["machine"]
        lines += [
            "",
            "## 7. Roofline (figure `bench_roofline.png`, beside the scaling figure)",
            "",
            f"Machine, measured in this run at {m['bandwidth']['threads']} thread(s): read bandwidth "
            f"{m['bandwidth']['read_Bps'] / 1e9:.1f} GB/s (sum over {m['bandwidth']['tensor_mb']} MiB; copy "
            f"{m['bandwidth']['copy_Bps'] / 1e9:.1f} GB/s), matmul "
            + ", ".join(f"M={k}: {v['flops_per_s'] / 1e9:.1f}" for k, v in m["matmul"].items())
            + f" GFLOP/s (F.linear, K={roof['shape']['hidden']}, N={roof['shape']['intermediate']}). "
            f"The {roof['formula']}; bytes and flops per step are counted as in `kvcert.bench.roofline` "
            f"(weights {roof['shape']['weight_bytes'] / 2**20:.0f} MiB per step).",
            "",
        ]
        header = ["tokens", "variants", "config", "step (ms)", "MiB / step", "GFLOP / step", "bound", "limit (ms)"]
        rows = [
            [
                f"{r['tokens']}",
                f"{r['variants']}",
                f"{r['config']}",
                f"{r['step_s'] * 1e3:.1f}",
                f"{r['bytes'] / 2**20:.0f}",
                f"{r['flops'] / 1e9:.2f}",
                f"{r['bound']}",
                f"{r['limit_s'] * 1e3:.2f}",
                f"{r['multiple']:.1f}x",
                f"{r['multiple_sum']:.1f}x",
            ]
            for r in roof["rows"]
        ]
        lines += md_table([*header, "multiple", "multiple (sum limit)"], rows)
    vs = res.get("versus")
    if vs:
        from kvcert.bench.versus import markdown

        lines += ["", "## 8. " + markdown(vs).removeprefix("# ")]
    path.write_text("\n".join(lines) + "\n")
