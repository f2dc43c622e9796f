"""Regenerate some examples of a study's confirmatory cell with this checkout's code and compare them, bit for bit,
with the raw records in results/runs/ (shards, or the merged tables when the shards are gone).

    python experiments/regenerate_check.py study2 study2/c1_coverage 0,200
    python experiments/regenerate_check.py study1 c1_coverage 1,100

Used at stop 16 on a fresh clone: study 2's examples 0 (1k) and 200 (4k) and study 1's examples 1 and 100 came out
identical in every column of the examples and step tables.
"""

import sys
from pathlib import Path

import pandas as pd
import torch

from kvcert.config import result_name
from kvcert.hf import generate_variants, load_model
from kvcert.records import example_frame, step_frame
from kvcert.reproduce import compose_claim, settings
from kvcert.run import decode_options, load_examples, policies
from kvcert.tasks.render import render


def main(study: str, claim: str, indices: list[int]) -> bool:
    st = settings(study)
    cfg = compose_claim(claim, st["overrides"])
    torch.set_num_threads(int(cfg.threads))
    model, tok = load_model(cfg.model.name, cache_dir=cfg.model.cache_dir, dtype=torch.float32, device="cpu")
    examples, name = load_examples(cfg, tok), result_name(cfg)
    run = Path("results/runs") / name
    same = True
    for i in indices:
        ex = examples[i]
        prompt = render(ex, tok, cfg.model.prompt_format)
        res = generate_variants(model, tok, prompt, policies(cfg), decode_options(cfg, prompt.stop_strings))
        new_ex, new_st = example_frame(name, ex, len(prompt.input_ids), res), step_frame(name, ex.id, res)
        shard = run / "shards" / f"{i:06d}"
        if shard.with_suffix(".examples.parquet").exists():
            old_ex = pd.read_parquet(shard.with_suffix(".examples.parquet"))
            old_st = pd.read_parquet(shard.with_suffix(".steps.parquet"))
        else:
            old_ex = pd.read_parquet(run / "examples.parquet", filters=[("example_id", "==", ex.id)])
            old_st = pd.read_parquet(run / "steps.parquet", filters=[("example_id", "==", ex.id)])
        ok_ex = new_ex.reset_index(drop=True).equals(old_ex.reset_index(drop=True))
        ok_st = new_st.reset_index(drop=True).equals(old_st.reset_index(drop=True))
        print(f"{study} {i} {ex.id}: examples identical {ok_ex}, steps identical {ok_st} ({len(new_st)} rows)")
        same &= ok_ex and ok_st
    return same


if __name__ == "__main__":
    raise SystemExit(0 if main(sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]) else 1)
