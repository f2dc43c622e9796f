"""What several draws of one policy cost (kvcert.hf.draws): one draw against the split halves (3 rows, one draw's
KV) and R = 2 and 4 independent draws (R rows: draw 0 plus R - 1 teacher-forced followers), in serving mode
(oracle off, certificate on), from one read of the prompt. Per configuration: seconds per answer (read + decode),
seconds per decode step and the KV held together (`union_kv_bytes`), each as a ratio to one draw measured in the
same run, the configurations alternating over the repetitions.

    python -m kvcert.bench.draws [--model smollm2-135m-instruct] [--tokens 1024] [--steps 16] [--reps 3]
        -> results/bench/draws_cpu.{md,json}
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcert.bench.common import StepTimer, no_eos, one_run_parser, one_run_setup, write_report

CONFIGS = ("one draw", "split halves", "2 draws", "4 draws")


def _rows(name: str, budget: float):
    from kvcert.hf.draws import Draws, draw_policies
    from kvcert.serve.generate import default_policy

    policy = default_policy(budget)
    if name == "one draw":
        return [policy], {}
    draws = Draws(variant="split") if name == "split halves" else Draws(count=int(name.split()[0]))
    return draw_policies(policy, draws)


def measure(model, ids: list[int], qs: int, steps: int, reps: int, budget: float = 0.5) -> dict[str, dict]:
    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading
    from kvcert.hf.draws import union_kv_bytes

    opts = DecodeOptions(max_new_tokens=steps, oracle=False, certificate=True)
    prompt = Prompt(input_ids=ids, question_start=qs, example_id="bench-draws")
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS}
    kv: dict[str, int] = {}
    with no_eos(model), torch.no_grad():
        for rep in range(reps + 1):  # the first round warms up and is not counted
            for name in CONFIGS[rep % len(CONFIGS) :] + CONFIGS[: rep % len(CONFIGS)]:
                policies, follow = _rows(name, budget)
                timer = StepTimer("cpu")
                t0 = time.perf_counter()
                batch = compress_while_reading(model, prompt, policies, opts)
                batch.decode(opts, None, on_step=timer, follow=follow)
                total = time.perf_counter() - t0
                kv[name] = union_kv_bytes(
                    batch, list(range(len(policies))), {i: steps + 1 for i in range(len(policies))}
                )
                if rep:
                    times[name].append((total, timer.step_s))
    base_total = statistics.median(t for t, _ in times["one draw"])
    base_step = statistics.median(s for _, s in times["one draw"])
    out = {}
    for name in CONFIGS:
        total = statistics.median(t for t, _ in times[name])
        step = statistics.median(s for _, s in times[name])
        out[name] = dict(answer_s=total, step_ms=1000 * step, answer_ratio=total / base_total,
                         step_ratio=step / base_step, kv_ratio=kv[name] / kv["one draw"])  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = one_run_parser(__doc__, "results/bench/draws_cpu")
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    model, ids, qs = one_run_setup(args)
    res = measure(model, ids, qs, args.steps, args.reps)
    text = write_report(
        args.out,
        "# Several draws of one policy: cost against one draw (kvcert.bench.draws)",
        f"{args.threads} thread(s); {args.model}, {args.tokens}-token prompt, budget 0.5, {args.steps} new tokens, "
        f"serving mode with the certificate; medians of {args.reps} alternating repetitions.",
        [dict(config=k, **v) for k, v in res.items()],
        args,
        res,
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
