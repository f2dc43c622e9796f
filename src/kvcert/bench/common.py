"""Shared pieces of the benchmark: profiles, the synthetic workload, loading, and decode-step timing through
`generate_variants(..., on_step=...)`."""

from __future__ import annotations

import dataclasses
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
QUESTION_TOKENS = 40
SCORERS = ("window_question", "window_context", "streaming")
DESIGNS = ("topk", "randomized")
BUDGETS = (0.25, 0.5, 0.75, 0.9)
# the decode engine's two backends: torch ops, and the compiled CPU kernel for single-token steps
TORCH_OPS = dict(backend="torch")  # the engine without the compiled CPU kernel (what runs on a GPU)


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
    # serving mode (oracle off): one policy at these budgets (1.0 = the full cache) per prompt length; 8,176 + the
    # new tokens stays inside SmolLM2's 8,192 positions
    serving_lengths: tuple[int, ...] = (4096, 8176)
    serving_budgets: tuple[float, ...] = (1.0, 0.5, 0.25)
    headline_variants: int = 24
    headline_tokens: int = 1024
    # roofline: decode step at every (variants, tokens), plain / certificate / certificate + oracle
    roofline_lengths: tuple[int, ...] = (1024, 2048, 4096)
    roofline_variants: tuple[int, ...] = (1, 8, 24)
    roofline_steps: int = 8
    roofline_reps: int = 3
    bandwidth_mb: int = 512
    machine_reps: int = 5
    # end to end: confirmatory examples (21 variants), before vs after, interleaved
    example_tasks: int = 5  # the first k tasks of the confirmatory task list
    example_lengths: tuple[int, ...] = (1024, 2048)
    example_per_cell: int = 1
    example_reps: int = 1


FULL_CONFIG = BenchConfig()
QUICK_CONFIG = BenchConfig(
    lengths=(1024,),
    variants=(1, 8, 24),
    prefill_reps=(1,),
    decode_steps=6,
    decode_reps=3,
    attention_reps=20,
    thread_reps=1,
    omp_reps=0,
    memory_lengths=(1024,),
    memory_variants=(24,),
    serving_lengths=(1024,),
    roofline_lengths=(1024,),
    roofline_steps=5,
    roofline_reps=2,
    bandwidth_mb=256,
    machine_reps=3,
    example_tasks=2,
    example_lengths=(1024,),
)


def policy_grid(n: int):
    """The first n of a realistic grid: budgets outer, then scorer x design (so small n still mixes them)."""
    from kvcert.policy import Policy

    grid = [Policy(scorer=s, design=d, budget=b) for b in BUDGETS for s in SCORERS for d in DESIGNS]
    if n > len(grid):
        grid += [
            Policy(scorer=s, design="randomized", budget=b, seed=k)
            for k in range(1, n)
            for b in BUDGETS
            for s in SCORERS
        ]
    return grid[:n]


def synthetic_prompt(model, n: int, seed: int = 0) -> tuple[list[int], int]:
    """Seeded random token ids; the last QUESTION_TOKENS (at most half) are the question."""
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()
    return ids, max(1, n - min(QUESTION_TOKENS, n // 2))


# SmolLM2-135M's architecture (LlamaForCausalLM), for `smollm2-135m-random`: its shape with seeded random weights, for
# time and memory where the packaged weights cannot go (a GPU machine without the package); never for answers
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def load(model_name: str, device: str, dtype: str):
    from kvcert.hf import load_model, tiny_random_model

    if model_name == "smollm2-135m-random":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
        return model.to(device=device, dtype=getattr(torch, dtype)), None
    if model_name.startswith("tiny-"):
        model, tok = tiny_random_model(model_name.removeprefix("tiny-"), max_position_embeddings=8192)
        return model.to(device=device, dtype=getattr(torch, dtype)), tok
    return load_model(model_name, dtype=getattr(torch, dtype), device=device)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median(xs) -> float:
    return float(statistics.median(xs))


def rotate(items, k):
    k %= len(items)
    return items[k:] + items[:k]


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


class StepTimer:
    """The `on_step` callback of generate_variants: the wall time of a decode step of one batch is the interval
    between consecutive calls (step k-1 -> k) of one decode loop, i.e. the step's forward plus the loop's per-step
    bookkeeping; prefill, compression and the first step's setup never fall inside an interval. A decode loop
    starts again at step 0 (today's code decodes question-aware and question-agnostic variants in two loops), so
    the time per step of the whole variant set is the sum over loops of each loop's mean interval."""

    def __init__(self, device="cpu"):
        self.device = device
        self.loops: list[list[float]] = []
        self._last: tuple[int, float] | None = None

    def __call__(self, step: int) -> None:
        sync(self.device)
        now = time.perf_counter()
        if step == 0 or self._last is None or step != self._last[0] + 1:
            self.loops.append([])
        else:
            self.loops[-1].append(now - self._last[1])
        self._last = (step, now)

    @property
    def step_s(self) -> float:
        means = [statistics.fmean(x) for x in self.loops if x]
        return float(sum(means)) if means else float("nan")

    @property
    def n_loops(self) -> int:
        return len(self.loops)


def run_generate(model, ids, qs, policies, opts, device, tokenizer=None):
    """(total seconds, seconds per decode step of the whole variant set, results)."""
    from kvcert.hf import Prompt, generate_variants

    if torch.device(device).type != "cpu" and getattr(opts, "backend", "auto") == "compiled":
        opts = dataclasses.replace(opts, backend="auto")  # the compiled kernel is a CPU kernel
    timer = StepTimer(device)
    sync(device)
    t0 = time.perf_counter()
    prompt = Prompt(input_ids=list(ids), question_start=qs, example_id="bench")
    res = generate_variants(model, tokenizer, prompt, policies, opts, on_step=timer)
    sync(device)
    return time.perf_counter() - t0, timer.step_s, res


def before_after_options(opts) -> tuple[object, object | None]:
    """(before, after) = the decode engine on torch ops, and on the compiled CPU kernel (what the kernel adds).
    On a DecodeOptions without `backend`, `before` is the options unchanged and `after` is None ('n/a')."""
    if "backend" not in {f.name for f in dataclasses.fields(opts)}:
        return opts, None
    return dataclasses.replace(opts, backend="torch"), dataclasses.replace(opts, backend="compiled")


def one_run_parser(doc: str, out: str):
    """The options every one-run benchmark (kvcert.bench.read, kvcert.bench.draws) takes: --model, --tokens, --reps,
    --threads, --out (default `out`); the caller adds its own."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=out)
    return ap


def one_run_setup(args) -> tuple:
    """(model, prompt ids, question start) for a one-run benchmark: its threads set, the model in float32 on the CPU,
    the seeded synthetic prompt of args.tokens tokens."""
    torch.set_num_threads(args.threads)
    model, _ = load(args.model, "cpu", "float32")
    ids, qs = synthetic_prompt(model, args.tokens)
    return model, ids, qs


def write_report(out, title: str, setup: str, rows: list[dict], args, results: dict) -> str:
    """A one-run benchmark's report: `out`.md (the title, the setup line after "CPU: <this CPU>, ", the rows as one
    Markdown table rounded to 3 digits) and `out`.json (the CPU, the arguments, the results); returns the text."""
    import json
    from pathlib import Path

    import pandas as pd

    from kvcert.analysis.tables import markdown_table
    from kvcert.records import cpu_model

    cpu = cpu_model()
    table = markdown_table(pd.DataFrame(rows).round(3))
    text = "\n".join([title, "", f"CPU: {cpu}, {setup}", "", table, ""])
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".md").write_text(text)
    path.with_suffix(".json").write_text(json.dumps(dict(cpu=cpu, args=vars(args), results=results), indent=2))
    return text
