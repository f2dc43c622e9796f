"""In-process measurements: shared prefill vs re-prefill, decode-step cost of certificate and oracle, the attention
kernel alone, thread settings, and seconds per confirmatory example before / after."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from kvcert.bench.common import (
    TORCH_OPS,
    before_after_options,
    median,
    policy_grid,
    rotate,
    run_generate,
    sync,
    synthetic_prompt,
)

DECODE_CONFIGS = {
    "plain": dict(certificate=False, oracle=False),
    "certificate": dict(certificate=True, oracle=False),
    "certificate+oracle": dict(certificate=True, oracle=True),
    # the certificate's parts: V_hat + diagnostics without tr(C^2); tr(C^2) refreshed every 8th step
    "certificate, no tight radius": dict(certificate=True, oracle=False, tight_radius=False),
    "certificate, tight radius every 8": dict(certificate=True, oracle=False, tight_radius_every=8),
    # the same engine on torch ops only (`decode.backend=torch`, what a GPU runs): what the compiled kernel adds
    "plain, torch ops": dict(certificate=False, oracle=False, **TORCH_OPS),
    "certificate, torch ops": dict(certificate=True, oracle=False, **TORCH_OPS),
    "certificate+oracle, torch ops": dict(certificate=True, oracle=True, **TORCH_OPS),
}


# ----------------------------------------------------------------------------------------------- 1. prefill
def bench_prefill(model, cfg, device, log) -> list[dict]:
    """Shared prefill + batched N variants vs the sum of N solo runs (each its own prefill + decode)."""
    from kvcert.hf import DecodeOptions

    opts = DecodeOptions(max_new_tokens=cfg.max_new_tokens)  # what the runner does: certificate and oracle on
    n_max = max(cfg.variants)
    grid = policy_grid(n_max)
    rows = []
    for li, n in enumerate(cfg.lengths):
        ids, qs = synthetic_prompt(model, n)
        reps = cfg.prefill_reps[min(li, len(cfg.prefill_reps) - 1)]
        # warm-up with the measured settings: with one rep the first timed job (shared N=1) otherwise paid this
        # length's first-touch costs alone (a 4k row once read 37.0 s shared vs 23.7 s re-prefilled for the same work)
        run_generate(model, ids, qs, grid[:1], opts, device)
        shared = {v: [] for v in cfg.variants}
        shared_step = {v: [] for v in cfg.variants}
        solo_totals: list[list[float]] = []
        for rep in range(reps):
            jobs = [("shared", v) for v in cfg.variants] + [("solo", i) for i in range(n_max)]
            solo = [0.0] * n_max
            for kind, x in rotate(jobs, rep * 7):
                if kind == "shared":
                    total, step, _ = run_generate(model, ids, qs, grid[:x], opts, device)
                    shared[x].append(total)
                    shared_step[x].append(step)
                else:
                    solo[x] = run_generate(model, ids, qs, [grid[x]], opts, device)[0]
            solo_totals.append(solo)
            log(
                f"  prefill n={n} rep {rep + 1}/{reps}: shared "
                + ", ".join(f"N={v}: {shared[v][-1]:.2f}s" for v in cfg.variants)
                + f"; solo sum N={n_max}: {sum(solo):.2f}s"
            )
        for v in cfg.variants:
            re = [sum(s[:v]) for s in solo_totals]
            rows.append(
                dict(
                    tokens=n,
                    variants=v,
                    reps=reps,
                    shared_s=median(shared[v]),
                    reprefill_s=median(re),
                    speedup=median([r / s for r, s in zip(re, shared[v])]),
                    decode_step_s=median(shared_step[v]),
                    solo_one_variant_s=median([s[0] for s in solo_totals]),
                )
            )
    return rows


# -------------------------------------------------------------------------------------------- 2. decode step
def bench_decode(model, cfg, device, log, configs=DECODE_CONFIGS, reps=None) -> dict:
    """Per decode step (all variants advance one token), configurations interleaved in rotated order."""
    from kvcert.hf import DecodeOptions

    ids, qs = synthetic_prompt(model, cfg.decode_tokens)
    policies = policy_grid(cfg.decode_variants)
    names = list(configs)
    opts = {k: DecodeOptions(max_new_tokens=cfg.decode_steps, **v) for k, v in configs.items()}
    run_generate(model, ids, qs, policies, replace(opts[names[0]], max_new_tokens=2), device)  # warm-up
    steps = {k: [] for k in names}
    for rep in range(reps or cfg.decode_reps):
        for k in rotate(names, rep):
            steps[k].append(run_generate(model, ids, qs, policies, opts[k], device)[1])
        log(f"  decode rep {rep + 1}: " + ", ".join(f"{k} {steps[k][-1] * 1e3:.1f} ms" for k in names))
    return {k: dict(step_s=median(v), samples_s=v) for k, v in steps.items()}


def bench_attention_only(cfg, device, head_dim=64, n_kv=3, group=3) -> dict:
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
        sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            hajek_attention(
                q, k, v, off, scale=scale, one_minus_pi=omp if cert else None, variance_slots=s, value_sq_norms=vsq
            )
        sync(device)
        return (time.perf_counter() - t0) / 10

    once(True)
    plain, cert = [], []
    for rep in range(cfg.attention_reps):
        for c in (False, True) if rep % 2 == 0 else (True, False):
            (cert if c else plain).append(once(c))
    return dict(
        shape=dict(variants=b, kv_heads=n_kv, group=group, kept=m, tail_slots=s, head_dim=head_dim),
        plain_s=median(plain),
        certificate_s=median(cert),
        ratio=median([c / p for c, p in zip(cert, plain)]),
    )


# ------------------------------------------------------------------------------ 6. end to end, before / after
def confirmatory_config():
    """The confirmatory cell's config, composed the way kvcert.reproduce.compose_claim('c1_coverage') does."""
    try:
        from kvcert.reproduce import compose_claim
    except ImportError:
        compose_claim = None
    if compose_claim is not None:
        return compose_claim("c1_coverage")
    from hydra import compose, initialize_config_dir

    from kvcert.run import config_dir  # importing kvcert.run registers the schema

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=["+claim=c1_coverage"])


def confirmatory_workload(model, tokenizer, cfg) -> tuple[list, list[dict], object]:
    """(policies, prompts, decode config): the confirmatory policy grid (21 variants) and, per example, its token ids,
    question start and stop strings -- real confirmatory-task examples when a tokenizer is given, otherwise
    synthetic prompts of the same lengths (no stop strings)."""
    from kvcert.config import policies as cell_policies

    ccfg = confirmatory_config()
    variants = cell_policies(ccfg)
    tasks = list(ccfg.task.tasks)[: cfg.example_tasks]
    prompts = []
    if tokenizer is not None:
        from kvcert.tasks import make_examples, render

        for length in cfg.example_lengths:
            for task in tasks:
                for ex in make_examples(
                    task, cfg.example_per_cell, int(length), tokenizer, seed=int(ccfg.seed), source=ccfg.task.source
                ):
                    r = render(ex, tokenizer)
                    prompts.append(
                        dict(
                            id=ex.id,
                            task=task,
                            tokens=len(r.input_ids),
                            ids=r.input_ids,
                            question_start=r.question_start,
                            stop=tuple(r.stop_strings),
                        )
                    )
    else:
        for length in cfg.example_lengths:
            for k in range(len(tasks) * cfg.example_per_cell):
                ids, qs = synthetic_prompt(model, int(length), seed=k)
                prompts.append(
                    dict(
                        id=f"synthetic-{length}-{k}",
                        task="synthetic",
                        tokens=len(ids),
                        ids=ids,
                        question_start=qs,
                        stop=(),
                    )
                )
    return variants, prompts, ccfg.decode


def bench_examples(model, tokenizer, cfg, device, log) -> dict:
    """Seconds per confirmatory example (all 21 variants: prefill, compression, decode with certificate and oracle,
    EOS and stop strings as in a real run) before vs after, interleaved per example in one run."""
    from kvcert.hf import DecodeOptions

    variants, prompts, d = confirmatory_workload(model, tokenizer, cfg)
    base = DecodeOptions(
        max_new_tokens=int(d.max_new_tokens),
        oracle=bool(d.oracle),
        certificate=bool(d.certificate),
        context_window=int(d.context_window),
        pool_kernel=int(d.pool_kernel),
    )
    before0, after0 = before_after_options(base)
    modes = {"before": before0} if after0 is None else {"before": before0, "after": after0}
    warm = prompts[0]
    run_generate(
        model,
        warm["ids"][:256] if len(warm["ids"]) > 256 else warm["ids"],  # warm-up
        min(warm["question_start"], 200),
        variants[:2],
        DecodeOptions(max_new_tokens=2),
        device,
        tokenizer,
    )
    times: dict[str, list[float]] = {k: [] for k in modes}
    rows, same = [], []
    for i, p in enumerate(prompts):
        for rep in range(cfg.example_reps):
            answers = {}
            for k in rotate(list(modes), i + rep):
                opts = replace(modes[k], stop_strings=p["stop"])
                total, _, res = run_generate(model, p["ids"], p["question_start"], variants, opts, device, tokenizer)
                times[k].append(total)
                answers[k] = [r.answer for r in res]
                rows.append(
                    dict(
                        example=p["id"],
                        task=p["task"],
                        tokens=p["tokens"],
                        mode=k,
                        seconds=total,
                        answer_tokens=sum(r.n_answer for r in res),
                    )
                )
            if "after" in answers:
                same.append(sum(a == b for a, b in zip(answers["before"], answers["after"])) / len(variants))
        log(f"  example {p['id']} ({p['tokens']} tokens): " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
    out = dict(
        variants=len(variants),
        examples=len(prompts),
        reps=cfg.example_reps,
        rows=rows,
        available_after=after0 is not None,
        tasks=sorted({p["task"] for p in prompts}),
        lengths=sorted({p["tokens"] for p in prompts}),
    )
    for k in ("before", "after"):
        if k in times:
            s = sum(times[k]) / len(times[k])
            out[k] = dict(seconds_per_example=s, examples_per_hour=3600 / s, median_s=median(times[k]))
        else:
            out[k] = None
    out["example_speedup"] = sum(times["before"]) / sum(times["after"]) if "after" in times else None
    out["answers_identical"] = (sum(same) / len(same)) if same else None
    return out
