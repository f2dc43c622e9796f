"""Before / after on one machine: seconds per `generate_variants` call of two revisions of kvcert, each revision in
its own fresh processes, interleaved (before, after, before, after, ...), with the same Python environment.

    python -m kvcert.bench.versus [--before 0c9eb6d] [--reps 2] [--out results/bench/engine_vs_fast_path]

`--before` is a git revision, exported with `git archive` to a temporary folder and imported from there; the default
is the last commit of the two-path engine with its four opt-in speed switches on (its fastest configuration). The
"after" side is this checkout's `src/` as it is (uncommitted changes included). Configurations: 24 variants at
1k / 2k / 4k tokens, certificate and oracle on / off, 16 new tokens (no EOS); and kvpress's own protocol: 11
configurations (the full cache; window_context, window_question, streaming, key_norm and random top-k at keep 0.5
and 0.25), 1k tokens, 16 new tokens, oracle and certificate off, each configuration decoded on its own as kvpress
does, so seconds per example = the sum of the 11 calls. Per (configuration, revision, repetition) a fresh process
loads the model, makes one small warm-up call (the compiled kernel, first allocations) and times one call; the
median over repetitions is reported, and the ratio before / after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pandas as pd

from kvcert.analysis.tables import markdown_table
from kvcert.records import cpu_model

BEFORE = "0c9eb6d"  # the last commit of the two-path engine (default path + opt-in fast path)
BEFORE_SWITCHES = dict(stats_after_forward=True, keys_transposed=True, fused_attention=True, packed_weights=True)
ROOT = Path(__file__).resolve().parents[3]
NEW_TOKENS = 16
KVPRESS_CONFIGS = [("full", None, 1.0)] + [
    (scorer, "topk", keep)
    for keep in (0.5, 0.25)
    for scorer in ("window_context", "window_question", "streaming", "key_norm", "random")
]

# Run inside the revision under test: imports only what both revisions have.
CHILD = r"""
import dataclasses, json, sys, time
import torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from kvcert.bench.common import load, no_eos, policy_grid, synthetic_prompt
from kvcert.hf import DecodeOptions, Prompt, generate_variants
from kvcert.policy import FULL, Policy

fields = {f.name for f in dataclasses.fields(DecodeOptions)}
opts = DecodeOptions(**{k: v for k, v in spec["options"].items() if k in fields})
model, _ = load(spec["model"], "cpu", "float32")
if spec["kvpress"]:
    calls = [[FULL if s == "full" else Policy(scorer=s, design=d, budget=b)] for s, d, b in spec["kvpress"]]
else:
    calls = [policy_grid(spec["variants"])]
ids, qs = synthetic_prompt(model, spec["tokens"])
with no_eos(model):
    warm = Prompt(input_ids=ids[:96], question_start=80, example_id="warm")
    generate_variants(model, None, warm, calls[0], dataclasses.replace(opts, max_new_tokens=2))
    prompt = Prompt(input_ids=ids, question_start=qs, example_id="versus")
    times = []
    for policies in calls:
        t0 = time.perf_counter()
        generate_variants(model, None, prompt, policies, opts)
        times.append(time.perf_counter() - t0)
print("RESULT " + json.dumps({"seconds": sum(times), "per_call": times}))
"""


KVPRESS_ROW = "kvpress protocol: 11 configurations, 1024 tokens"


def configurations(quick: bool = False) -> list[dict]:
    rows = [
        dict(name=f"{n} tokens, 24 variants, {label}", tokens=n, variants=24, kvpress=None, on=on)
        for n in ((1024,) if quick else (1024, 2048, 4096))
        for on, label in ((True, "certificate+oracle"), (False, "plain"))
    ]
    rows.append(dict(name=KVPRESS_ROW, tokens=1024, variants=1, on=False))
    rows[-1]["kvpress"] = KVPRESS_CONFIGS
    return rows


def export(revision: str, into: Path) -> Path:
    """`git archive revision src` unpacked under `into`; returns its src folder."""
    archive = into / "src.tar"
    try:
        with archive.open("wb") as f:
            subprocess.run(["git", "-C", str(ROOT), "archive", revision, "src"], stdout=f, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(
            f"cannot export revision {revision!r} from {ROOT} ({err}); run from a git clone of kvcert, or pass "
            "--before with a revision this clone has"
        ) from None
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_child(src: Path, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(spec["threads"])}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True, cwd=src.parent
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-6:])
        raise RuntimeError(f"the benchmark child for {src} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(line.removeprefix("RESULT "))


def run(
    before: str = BEFORE,
    reps: int = 2,
    model: str = "smollm2-135m-instruct",
    threads: int = 1,
    quick: bool = False,
    log=print,
) -> dict:
    """Every configuration, interleaved before / after, `reps` times; returns the table's rows and the ratios."""
    with tempfile.TemporaryDirectory(prefix="kvcert-versus-") as tmp:
        sides = {"before": export(before, Path(tmp)), "after": ROOT / "src"}
        rows = []
        for cfg in configurations(quick):
            samples: dict[str, list[float]] = {"before": [], "after": []}
            for rep in range(reps):
                for side in ("before", "after") if rep % 2 == 0 else ("after", "before"):
                    on = cfg["on"]
                    options = dict(max_new_tokens=NEW_TOKENS, certificate=on, oracle=on)
                    if side == "before":
                        options.update(BEFORE_SWITCHES)
                    spec = dict(
                        model=model,
                        threads=threads,
                        tokens=cfg["tokens"],
                        variants=cfg["variants"],
                        kvpress=cfg["kvpress"],
                        options=options,
                    )
                    samples[side].append(run_child(sides[side], spec)["seconds"])
            b, a = statistics.median(samples["before"]), statistics.median(samples["after"])
            rows.append(dict(configuration=cfg["name"], before_s=b, after_s=a, ratio=b / a, samples=samples))
            log(f"  {cfg['name']}: before {b:.2f} s, after {a:.2f} s, before / after {b / a:.2f}x")
    return dict(
        before=before,
        before_switches=BEFORE_SWITCHES,
        after="this checkout (src/)",
        model=model,
        threads=threads,
        reps=reps,
        new_tokens=NEW_TOKENS,
        cpu=cpu_model(),
        cpu_count=os.cpu_count(),
        rows=rows,
        kvpress_protocol_s_per_example=next(r["after_s"] for r in rows if r["configuration"] == KVPRESS_ROW),
    )


def markdown(res: dict) -> str:
    switches = ", ".join(f"`{k}`" for k in res["before_switches"])
    lines = [
        "# The one decode engine vs the earlier fast path",
        "",
        f"Seconds per `generate_variants` call, `{res['model']}`, synthetic prompt, {res['new_tokens']} new tokens "
        f"(no EOS), {res['threads']} thread(s), float32. Before: commit `{res['before']}` with its opt-in switches "
        f"on ({switches}). After: {res['after']}, `DecodeOptions()` (backend auto). Each number is the median of "
        f"{res['reps']} fresh processes, run interleaved (`python -m kvcert.bench.versus`). CPU: {res['cpu']}, "
        f"{res['cpu_count']} cores.",
        "",
        "kvpress protocol: each of the 11 configurations decoded on its own (a prefill each), seconds per example = "
        "the sum of the 11 calls.",
        "",
    ]
    rows = [
        [f"{r['configuration']}", f"{r['before_s']:.2f}", f"{r['after_s']:.2f}", f"{r['ratio']:.2f}x"]
        for r in res["rows"]
    ]
    header = ["configuration", "before (s)", "after (s)", "before / after"]
    lines.append(markdown_table(pd.DataFrame(rows, columns=header), parse_numbers=False))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcert.bench.versus", description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help=f"git revision to compare against (default {BEFORE})")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/bench/engine_vs_fast_path"))
    args = ap.parse_args(argv)
    try:
        res = run(args.before, args.reps, threads=args.threads, log=lambda m: print(m, flush=True))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
