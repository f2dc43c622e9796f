"""What compressing while reading costs against one plain forward of the same prompt (serving mode, certificate on),
and where the difference goes. Per workload (one policy; a grid of prompt-time policies; kvpress's 11
configurations, which read the question again through each context-time cache): the read's seconds as a ratio to
`model.model(ids)` (the transformer without its head, what any read costs at least), measured alternately in one run,
and one profiled read split into its parts (the forward's attention, the per-policy selection, the copy of the kept
tokens out of each layer, building the decode buffers). Beside them, the read's floor: the plain forward plus one
write of the decode buffers the read leaves (every variant's kept keys, values, offsets and 1 - pi), timed in the same
run as a copy of those bytes into new memory; a read cannot cost less without a smaller cache.

    python -m kvcert.bench.read [--model smollm2-135m-instruct] [--tokens 1024] [--reps 3] [--grid 24]
        [--huge-pages] -> results/bench/read_cpu.{md,json}

--huge-pages: torch's CPU allocator backs large tensors with transparent huge pages (THP_MEM_ALLOC_ENABLE=1, set
before the model loads; the kernel's THP mode must allow madvise): fewer page faults when the decode buffers are first
written, for the plain forward too. A user setting, off by default; the report says which was used and how much
memory the process held in huge pages.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time

import torch

from kvcert.bench.common import one_run_parser, one_run_setup, policy_grid, write_report
from kvcert.hf.huge_pages import empty_on_huge_pages

# the parts of a read, by the functions that do each (module path fragment, function names)
PARTS = {
    "selection (scores, design)": ("hf/compress.py", ("select_layers", "select_layers_together", "select_together")),
    "copy out of the layer": ("hf/compressed_batch.py", ("_take_tokens",)),
    "decode buffers": ("hf/compressed_batch.py", ("_build_bucket",)),
    "attention (prompt)": ("hf/attention.py", ("causal_attention",)),
    "probe": ("hf/serving_prefill.py", ("_probe",)),
}


def workloads(grid: int) -> dict[str, list]:
    from kvcert.bench.kvpress_speed import kvcert_policies
    from kvcert.serve.generate import default_policy

    return {
        "one policy": [default_policy(0.5)],
        f"{grid}-variant grid, prompt-time": [p for p in policy_grid(grid) if p.compress_after == "prompt"],
        "kvpress's 11 configurations": kvcert_policies(),
    }


def parts_of(profile: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds of each part of a profiled read."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    out = dict.fromkeys(PARTS, 0.0)
    for (path, _, name), (_, _, _, cumulative, _) in stats.items():
        for part, (fragment, functions) in PARTS.items():
            if name in functions and path.replace("\\", "/").endswith(fragment):
                out[part] += cumulative
    return out


def buffer_tensors(batch) -> list[torch.Tensor]:
    """The decode buffers a read leaves: per bucket and layer, the kept keys, values, offsets and 1 - pi."""
    return [t for bucket in batch.state.buckets for layer in bucket.layers
            for t in (layer.keys, layer.values, layer.offset, layer.one_minus_pi)]  # fmt: skip


def write_seconds(tensors: list[torch.Tensor], reps: int) -> float:
    """Median seconds to write these tensors once into new memory (allocation and first touch included, as the read
    pays them, on huge pages where the read asks for them): the floor's cost of leaving a cache of this size."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copies = [empty_on_huge_pages(*t.shape, like=t).copy_(t) for t in tensors]
        times.append(time.perf_counter() - t0)
        del copies
    return statistics.median(times)


def measure(model, ids: list[int], qs: int, grid: int, reps: int) -> dict[str, dict]:
    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading

    opts = DecodeOptions(max_new_tokens=16, oracle=False, certificate=True)
    prompt = Prompt(input_ids=ids, question_start=qs, example_id="bench-read")
    x = torch.tensor([ids], device=model.device)
    out = {}
    with torch.no_grad():
        for name, policies in workloads(grid).items():
            compress_while_reading(model, prompt, policies, opts)  # warm-up
            plain, read = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                model.model(x)
                t1 = time.perf_counter()
                compress_while_reading(model, prompt, policies, opts)
                t2 = time.perf_counter()
                plain.append(t1 - t0)
                read.append(t2 - t1)
            profile = cProfile.Profile()
            profile.enable()
            batch = compress_while_reading(model, prompt, policies, opts)
            profile.disable()
            buffers = buffer_tensors(batch)
            written = write_seconds(buffers, reps)
            p, r = statistics.median(plain), statistics.median(read)
            out[name] = dict(policies=len(policies), plain_s=p, read_s=r, ratio=r / p,
                             buffers_mb=sum(t.numel() * t.element_size() for t in buffers) / 1e6,
                             write_s=written, floor_ratio=(p + written) / p, parts_s=parts_of(profile))  # fmt: skip
    return out


def huge_page_mb() -> float | None:
    """MB of this process's anonymous memory in transparent huge pages (Linux), None where that cannot be read."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = one_run_parser(__doc__, "results/bench/read_cpu")
    ap.add_argument("--grid", type=int, default=24)
    ap.add_argument("--huge-pages", action="store_true", help="THP_MEM_ALLOC_ENABLE=1 for this run (see above)")
    args = ap.parse_args(argv)
    if args.huge_pages:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch's allocator, so set before anything large exists
    model, ids, qs = one_run_setup(args)
    res = measure(model, ids, qs, args.grid, args.reps)
    pages = huge_page_mb()
    rows = [dict(workload=k, policies=v["policies"], plain_s=v["plain_s"], read_s=v["read_s"], ratio=v["ratio"],
                 buffers_mb=v["buffers_mb"], write_s=v["write_s"], floor_ratio=v["floor_ratio"],
                 **{f"{p} s": s for p, s in v["parts_s"].items()}) for k, v in res.items()]  # fmt: skip
    text = write_report(
        args.out,
        "# Compressing while reading against one plain forward (kvcert.bench.read)",
        f"{args.threads} thread(s); {args.model}, {args.tokens}-token prompt; serving mode, certificate on; read and "
        f"plain forward alternating, medians of {args.reps}; floor_ratio: (plain forward + one write of the "
        "buffers_mb the read leaves, write_s) / plain forward; the parts from one profiled read (cProfile cumulative "
        "seconds, inflated by the profiler). Huge pages (THP_MEM_ALLOC_ENABLE): "
        f"{'on' if args.huge_pages else 'off'}; "
        f"{'unknown' if pages is None else f'{pages:.0f} MB'} of this process's memory in huge pages at the end.",
        rows,
        args,
        res,
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
