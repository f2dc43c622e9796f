"""Where one certified decode step's time goes, against its roofline limit and its one-thread floor, in one run.

The step of N variants (default 24, a 1,024-token prompt) is timed as in the roofline sweep (`kvcert.bench.roofline`)
and split into four parts by timers around them:

- linear: every nn.Linear of the model (q, k, v, o, the MLP, the LM head);
- attention: the engine's single-token attention over the compressed caches (the compiled kernel or torch ops);
- statistics: the certificate's and the oracle's statistics of all layers after the forward (`finish_step`);
- rest: everything else (norms, rotary embeddings, residuals, sampling, the loop's bookkeeping).

Beside them, from the same run's machine measurements:

- limit: max(bytes / bandwidth, flops / matmul rate at M = N), the roofline's (overlapped transfers and arithmetic);
- floor: what one thread executing the step's kernels one after another cannot beat: the linear layers at their
  own roofline, max(weight bytes / bandwidth, linear flops / matmul rate), then everything else at its own (the
  caches, the certificate's tail, the oracle's prefix and the logits against their flops). floor / limit is the
  best multiple a one-thread step can reach without overlapping the attention's reads with the GEMMs' arithmetic.

The machine line also gives the matmul rate with the weight prepacked for M (MKL's packed GEMM, where this torch has
it): what the linear layers could reach with packed weights, which the engine does not use (docs/performance.md).

    python -m kvcert.bench.step [--model smollm2-135m-instruct] [--tokens 1024] [--variants 24] [--steps 8]
        [--reps 3] -> results/bench/step_cpu.{md,json}
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvcert.bench.common import no_eos, one_run_parser, one_run_setup, policy_grid, write_report
from kvcert.bench.roofline import (
    COST_FLAGS,
    ROOFLINE_CONFIGS,
    ModelShape,
    limit,
    loads_from_results,
    machine_rates,
    step_cost,
)

PARTS = ("linear", "attention", "statistics")
CONFIGS = ("plain", "certificate", "certificate+oracle")


@contextmanager
def timed_parts(model) -> Iterator[Counter]:
    """Seconds spent in each of PARTS while the context is open and `counter["on"]` is 1 (the caller switches it on
    for the timed steps only); the model and the engine are restored on exit."""
    from kvcert.hf.compressed_state import CompressedState

    acc: Counter = Counter()

    def timed(fn, part: str):
        def run(*args, **kwargs):
            if not acc["on"]:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[part] += time.perf_counter() - t0

        return run

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    engine = {name: getattr(CompressedState, name) for name in ("attend", "finish_step")}
    for m in linears:
        m.forward = timed(m.forward, "linear")
    CompressedState.attend = timed(engine["attend"], "attention")
    CompressedState.finish_step = timed(engine["finish_step"], "statistics")
    try:
        yield acc
    finally:
        for m in linears:
            del m.forward
        for name, fn in engine.items():
            setattr(CompressedState, name, fn)


class _Window:
    """The `on_step` callback: switches the part timers on after step 0 and off after step steps - 1, so steps
    1 .. steps-1 are timed, as in the roofline sweep; `seconds` is that window's wall time."""

    def __init__(self, acc: Counter, steps: int):
        self.acc, self.steps, self.t0, self.seconds = acc, steps, 0.0, 0.0

    def __call__(self, step: int) -> None:
        if step == 0:
            self.acc.clear()
            self.acc["on"] = 1
            self.t0 = time.perf_counter()
        elif step == self.steps - 1:
            self.seconds = time.perf_counter() - self.t0
            self.acc["on"] = 0


def packed_matmul_rate(m: int, k: int, n: int, reps: int = 5) -> float | None:
    """FLOP/s of MKL's packed GEMM at (m, k) x (k, n), the weight packed once for M = m (None without the op)."""
    try:
        w = torch.randn(n, k)
        x = torch.randn(m, k)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        torch.ops.mkl._mkl_linear(x, packed, w, None, m)
    except (AttributeError, RuntimeError):
        return None
    iters, best = 50, float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.ops.mkl._mkl_linear(x, packed, w, None, m)
        best = min(best, (time.perf_counter() - t0) / iters)
    return 2 * m * k * n / best


def floor_s(cost: dict, bandwidth: float, matmul_flops: float) -> float:
    """The one-thread floor (module docstring): the linear layers at their own roofline, then the rest at its own
    (the attention's flops at the matmul rate too); never below the limit, the max of the sums (taken again at the
    end: when both parts are bound the same way the split sum can round one ulp below it)."""
    linear = max(cost["bytes_by"]["weights"] / bandwidth, cost["flops_by"]["weights"] / matmul_flops)
    rest_bytes, rest_flops = cost["bytes"] - cost["bytes_by"]["weights"], cost["flops"] - cost["flops_by"]["weights"]
    floor = linear + max(rest_bytes / bandwidth, rest_flops / matmul_flops)
    return max(floor, cost["bytes"] / bandwidth, cost["flops"] / matmul_flops)


def measure(model, ids: list[int], qs: int, variants: int, steps: int, reps: int) -> dict:
    from kvcert.hf import DecodeOptions, Prompt, generate_variants

    shape = ModelShape.from_model(model)
    policies = policy_grid(variants)
    prompt = Prompt(input_ids=ids, question_start=qs, example_id="bench-step")
    machine = machine_rates(shape, variants)
    bw, mm = machine["bandwidth_Bps"], machine["matmul_flops"]
    packed = packed_matmul_rate(variants, shape.hidden, shape.intermediate)
    samples: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    loads = None
    with no_eos(model), torch.no_grad(), timed_parts(model) as acc:
        for rep in range(reps + 1):  # the first round warms up and is not counted
            for name in CONFIGS[rep % len(CONFIGS) :] + CONFIGS[: rep % len(CONFIGS)]:
                timer = _Window(acc, steps)
                opts = DecodeOptions(max_new_tokens=steps, **ROOFLINE_CONFIGS[name])
                results = generate_variants(model, None, prompt, policies, opts, on_step=timer)
                if loads is None:
                    loads = loads_from_results(results, len(ids), qs, steps)
                if rep:
                    n = steps - 1
                    parts = {p: acc[p] / n for p in PARTS}
                    samples[name].append(dict(step=timer.seconds / n, **parts))
    rows = {}
    for name in CONFIGS:
        med = {k: statistics.median(s[k] for s in samples[name]) for k in ("step", *PARTS)}
        flags = ROOFLINE_CONFIGS[name]
        cost = step_cost(shape, loads, len(ids), **{f: flags[f] for f in COST_FLAGS})
        lim = limit(cost, bw, mm)
        flo = floor_s(cost, bw, mm)
        ms = {k: 1000 * v for k, v in med.items()}
        rows[name] = dict(
            step_ms=ms["step"],
            **{f"{p}_ms": ms[p] for p in PARTS},
            rest_ms=ms["step"] - sum(ms[p] for p in PARTS),
            limit_ms=1000 * lim["limit_s"],
            bound=lim["bound"],
            floor_ms=1000 * flo,
            multiple=med["step"] / lim["limit_s"],
            floor_multiple=flo / lim["limit_s"],
        )
    return dict(machine=dict(machine, packed_matmul_flops=packed), rows=rows)


def main(argv: list[str] | None = None) -> int:
    p = one_run_parser(__doc__, "results/bench/step_cpu")
    p.add_argument("--variants", type=int, default=24)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    model, ids, qs = one_run_setup(args)
    res = measure(model, ids, qs, args.variants, args.steps, args.reps)
    m = res["machine"]
    packed = f"{m['packed_matmul_flops'] / 1e9:.1f}" if m["packed_matmul_flops"] else "n/a"
    text = write_report(
        args.out,
        "# One decode step: its parts, its roofline limit and its one-thread floor (kvcert.bench.step)",
        f"{args.threads} thread(s); {args.model}, {args.tokens}-token prompt, {args.variants} variants, steps 1-"
        f"{args.steps - 1} of {args.steps} timed; medians of {args.reps} alternating repetitions. Machine in this run: "
        f"read bandwidth {m['bandwidth_Bps'] / 1e9:.1f} GB/s; matmul at M = {args.variants}: F.linear "
        f"{m['matmul_flops'] / 1e9:.1f} GFLOP/s (the limit's rate), weight prepacked (MKL) {packed} GFLOP/s.",
        [dict(config=k, **v) for k, v in res["rows"].items()],
        args,
        res,
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
