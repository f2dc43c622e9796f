"""A roofline for the decode step: what one step of N variants must move and compute, this machine's memory
bandwidth and matmul throughput measured in the same run, and the measured step time as a multiple of the limit.

Per decode step of N variants (one token each), counted as the minimum traffic, every needed byte read once:

  bytes = W + N * E                                        weights: every parameter read once per step (fp32 here),
                                                           the LM head included; E = one embedding row per variant
                                                           when the input embedding is not tied to the LM head
        + sum_v (kept_v + appended_v) * L * Hkv * (2 d + 1) * 4    each variant's retained K and V (+ its fp32
                                                           offset) in every layer; appended = tokens written after
                                                           compression (question for question-agnostic variants,
                                                           generated tokens), the current one included
        + [cert]   sum_v tail_v * L * Hkv * 2 * 4          1 - pi and ||v||^2 of the tail slots
        + [oracle] n * L * Hkv * 2 d * 4                   the full prompt's K and V: one batch-1 prefix shared by
                                                           every variant, read once per layer by one matmul (the
                                                           variants' own appended tokens are already counted above)
        + N * vocab * 4                                    the logits written

  flops = 2 N P_lin                                        every Linear (q, k, v, o, MLP, LM head), P_lin = sum in*out
        + sum_v 4 (kept_v + appended_v) d Hq L             q.K and p.V over the retained cache
        + [cert]   sum_v 2 tail_v d Hq L                   the certificate's extra (a @ V_tail)
        + [oracle] sum_v 4 (n + generated_v) d Hq L        the exact attention over the full cache

Elementwise work (softmax, norms, RoPE, statistics) is not counted. The limit of a step is
max(bytes / bandwidth, flops / matmul throughput at M = N): the classic roofline bound, reached when transfers and
arithmetic overlap perfectly (the sum, the no-overlap bound, is reported beside it). Bandwidth is the best of
`machine_reps` passes of a STREAM-like read (sum) over a tensor far larger than the caches (the copy figure is
reported too); matmul throughput is the best of `machine_reps` timings of F.linear at the decode shape
(M = variants, K = hidden, N = MLP intermediate) with the weight cache-resident, so it measures the arithmetic rate
at that M; both at the thread count of the step measurement.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from kvcert.bench.common import TORCH_OPS

F32 = 4


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_bytes: int  # parameters read per step (embedding table excluded unless tied to the LM head)
    embed_row_bytes: int  # bytes of one embedding row read per variant (0 when tied: the LM head reads the table)
    linear_params: int  # sum of in * out over every nn.Linear, LM head included

    @classmethod
    def from_model(cls, model) -> ModelShape:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
        seen, weight_bytes = set(), 0
        for p in model.parameters():
            if p.data_ptr() in seen or (p.data_ptr() == emb.data_ptr() and not tied):
                continue
            seen.add(p.data_ptr())
            weight_bytes += p.numel() * p.element_size()
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        return cls(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            intermediate=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
            q_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            vocab=cfg.vocab_size,
            weight_bytes=weight_bytes,
            embed_row_bytes=0 if tied else emb.shape[1] * emb.element_size(),
            linear_params=linear,
        )


@dataclass(frozen=True)
class VariantLoad:
    kept: float  # prompt tokens kept per (layer, KV head)
    appended: float  # tokens in the cache after compression at this step (incl. the current token)
    tail: float  # tail slots carrying 1 - pi (0 for top-k and the full cache)
    generated: float  # generated tokens at this step (incl. the current one): what the oracle adds to the prompt


def step_cost(
    shape: ModelShape, loads: list[VariantLoad], prompt_tokens: int, *, certificate: bool, oracle: bool
) -> dict:
    """Bytes and flops one decode step must move / compute (module docstring), itemized."""
    n = len(loads)
    L, hkv, hq, d = shape.layers, shape.kv_heads, shape.q_heads, shape.head_dim
    b = dict(
        weights=shape.weight_bytes + n * shape.embed_row_bytes,
        kv=sum(v.kept + v.appended for v in loads) * L * hkv * (2 * d + 1) * F32,
        certificate=sum(v.tail for v in loads) * L * hkv * 2 * F32 if certificate else 0,
        oracle=prompt_tokens * L * hkv * 2 * d * F32 if oracle else 0,
        logits=n * shape.vocab * F32,
    )
    f = dict(
        weights=2 * n * shape.linear_params,
        attention=sum(4 * (v.kept + v.appended) * d * hq * L for v in loads),
        certificate=sum(2 * v.tail * d * hq * L for v in loads) if certificate else 0,
        oracle=sum(4 * (prompt_tokens + v.generated) * d * hq * L for v in loads) if oracle else 0,
    )
    return dict(bytes=float(sum(b.values())), flops=float(sum(f.values())), bytes_by=b, flops_by=f)


def limit(cost: dict, bandwidth: float, matmul_flops: float) -> dict:
    t_mem, t_comp = cost["bytes"] / bandwidth, cost["flops"] / matmul_flops
    return dict(
        memory_s=t_mem,
        compute_s=t_comp,
        limit_s=max(t_mem, t_comp),
        limit_sum_s=t_mem + t_comp,
        bound="memory" if t_mem >= t_comp else "compute",
    )


def loads_from_results(results, prompt_tokens: int, question_start: int, steps: int) -> list[VariantLoad]:
    """Per-variant loads at the mean timed step: intervals cover steps 1 .. steps-1, whose forward appends token
    k + 1 (k = step), so on average 1 + steps / 2 generated tokens; question-agnostic variants also hold the
    question they read through their compressed cache."""
    gen = 1 + steps / 2
    out = []
    for r in results:
        p = r.policy
        appended = gen + (0 if p.question_aware else prompt_tokens - question_start)
        tail = r.kept_tokens * p.tail_fraction if p.has_certificate else 0.0
        out.append(VariantLoad(float(r.kept_tokens), float(appended), float(tail), float(gen)))
    return out


# ------------------------------------------------------------------------------------------ machine limits
def measure_bandwidth(mb: int = 512, reps: int = 5, device: str = "cpu") -> dict:
    """STREAM-like: the best of `reps` passes of sum (read) and copy_ (read + write) over an mb-MiB tensor."""
    from kvcert.bench.common import sync

    n = mb * 2**20 // F32
    x = torch.empty(n, device=device).uniform_()
    y = torch.empty_like(x)
    x.sum()
    y.copy_(x)  # touch both (first-touch page faults are not bandwidth)
    best_sum = best_copy = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        t1 = time.perf_counter()
        y.copy_(x)
        sync(device)
        t2 = time.perf_counter()
        best_sum, best_copy = min(best_sum, t1 - t0), min(best_copy, t2 - t1)
    nbytes = n * F32
    del x, y
    return dict(
        tensor_mb=mb,
        read_Bps=nbytes / best_sum,
        copy_Bps=2 * nbytes / best_copy,
        bandwidth_Bps=nbytes / best_sum,
        threads=torch.get_num_threads(),
    )


def measure_matmul(m: int, k: int, n: int, reps: int = 5, device: str = "cpu", min_s: float = 0.05) -> dict:
    """F.linear(x (m, k), w (n, k)) as a decode step's Linear does it; best of reps, each >= min_s of calls."""
    from kvcert.bench.common import sync

    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    out = torch.empty(m, n, device=device)
    torch.nn.functional.linear(x, w)
    iters, elapsed = 1, 0.0
    while True:  # calibrate the call count
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(x, w.t(), out=out)
        sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s or iters >= 1 << 16:
            break
        iters *= 2
    best = elapsed / iters
    for _ in range(reps - 1):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(x, w.t(), out=out)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    return dict(m=m, k=k, n=n, flops_per_s=2 * m * k * n / best, threads=torch.get_num_threads())


def machine_rates(shape: ModelShape, m: int) -> dict:
    """This machine's read bandwidth and matmul rate at M = m (decode shape, defaults of the two measurements), for
    the one-run benchmarks that need the roofline limit at one batch size."""
    return dict(
        bandwidth_Bps=measure_bandwidth()["bandwidth_Bps"],
        matmul_flops=measure_matmul(m, shape.hidden, shape.intermediate)["flops_per_s"],
    )


def measure_machine(shape: ModelShape, variants, cfg, device: str, log) -> dict:
    bw = measure_bandwidth(cfg.bandwidth_mb, cfg.machine_reps, device)
    mm = {str(v): measure_matmul(v, shape.hidden, shape.intermediate, cfg.machine_reps, device) for v in variants}
    log(
        f"  machine: read {bw['read_Bps'] / 1e9:.1f} GB/s, copy {bw['copy_Bps'] / 1e9:.1f} GB/s; matmul "
        + ", ".join(f"M={k}: {v['flops_per_s'] / 1e9:.1f} GFLOP/s" for k, v in mm.items())
    )
    return dict(bandwidth=bw, matmul=mm)


# --------------------------------------------------------------------------------------------- the sweep
ROOFLINE_CONFIGS = {
    "plain": dict(certificate=False, oracle=False),
    "certificate": dict(certificate=True, oracle=False),
    "certificate+oracle": dict(certificate=True, oracle=True),
    # the torch-ops backend moves the same bytes and flops (the cost model below does not see the backend)
    "certificate+oracle, torch ops": dict(certificate=True, oracle=True, **TORCH_OPS),
}
COST_FLAGS = ("certificate", "oracle")  # the configuration keys the cost model reads


def bench_roofline(model, cfg, device, log) -> dict:
    """Measured decode step vs the limit at every (variants, tokens) and configuration (interleaved, medians)."""
    from kvcert.bench.common import median, policy_grid, rotate, run_generate, synthetic_prompt
    from kvcert.hf import DecodeOptions

    shape = ModelShape.from_model(model)
    machine = measure_machine(shape, cfg.roofline_variants, cfg, device, log)
    bw = machine["bandwidth"]["bandwidth_Bps"]
    rows = []
    for tokens in cfg.roofline_lengths:
        ids, qs = synthetic_prompt(model, tokens)
        for nv in cfg.roofline_variants:
            policies = policy_grid(nv)
            opts = {k: DecodeOptions(max_new_tokens=cfg.roofline_steps, **v) for k, v in ROOFLINE_CONFIGS.items()}
            # warm-up; its results give the kept counts
            _, _, results = run_generate(model, ids, qs, policies, DecodeOptions(max_new_tokens=2), device)
            loads = loads_from_results(results, tokens, qs, cfg.roofline_steps)
            times = {k: [] for k in opts}
            for rep in range(cfg.roofline_reps):
                for k in rotate(list(opts), rep):
                    times[k].append(run_generate(model, ids, qs, policies, opts[k], device)[1])
            for k, flags in ROOFLINE_CONFIGS.items():
                cost = step_cost(shape, loads, tokens, **{f: flags[f] for f in COST_FLAGS})
                lim = limit(cost, bw, machine["matmul"][str(nv)]["flops_per_s"])
                step = median(times[k])
                rows.append(
                    dict(
                        tokens=tokens,
                        variants=nv,
                        config=k,
                        step_s=step,
                        samples_s=times[k],
                        **cost,
                        **lim,
                        multiple=step / lim["limit_s"],
                        multiple_sum=step / lim["limit_sum_s"],
                        intensity=cost["flops"] / cost["bytes"],
                        achieved_flops_per_s=cost["flops"] / step,
                    )
                )
            log(
                f"  roofline n={tokens} N={nv}: "
                + ", ".join(
                    f"{r['config']} {r['step_s'] * 1e3:.1f} ms = {r['multiple']:.1f}x limit ({r['bound']})"
                    for r in rows[-len(ROOFLINE_CONFIGS) :]
                )
            )
    return dict(
        shape=asdict(shape),
        machine=machine,
        rows=rows,
        formula="limit = max(bytes / bandwidth, flops / matmul_throughput(M = variants))",
    )
