"""EXPLORATORY: full-cache accuracy of Qwen2.5-Coder-0.5B-Instruct per task x length x difficulty level (n small).

    MAX_NEW=32 python qwen_levels.py predictions.jsonl LENGTH N TASK=LEVEL [TASK=LEVEL ...]
    python summarize.py predictions.jsonl summary.csv

Plain transformers greedy decoding on the full cache (kvcert.tasks.calibrate.generate_answer: the render's stop
strings, the answer cut at the first one), the chat rendering, MAX_NEW new tokens (default 32), seed 13000, one
thread; one JSON line per example, appended, with its seconds (render excluded, prefill and decode included).
"""

import json
import os
import sys
import time

import torch

from kvcert.hf.loading import load_model
from kvcert.tasks import make_examples, render, score
from kvcert.tasks.calibrate import generate_answer
from kvcert.tasks.render import resolve_prompt_format

SEED = 13000
MAX_NEW = int(os.environ.get("MAX_NEW", "32"))


def main() -> None:
    torch.set_num_threads(1)
    out, length, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cells = [(a.split("=")[0], int(a.split("=")[1])) for a in sys.argv[4:]]
    model, tok = load_model("qwen2.5")
    fmt = resolve_prompt_format(tok, "auto")
    with open(out, "a") as f:
        for task, level in cells:
            for ex in make_examples(task, n, length, tok, SEED, level=level):
                r = render(ex, tok, fmt)
                t0 = time.perf_counter()
                ans = generate_answer(model, tok, r.input_ids, r.stop_strings, MAX_NEW)
                sec = time.perf_counter() - t0
                value, ok = score(ans, ex)
                rec = {
                    "task": task,
                    "level": level,
                    "length": length,
                    "id": ex.id,
                    "prompt_tokens": len(r.input_ids),
                    "answer": ans,
                    "gold": list(ex.answers),
                    "score": value,
                    "correct": bool(ok),
                    "seconds": round(sec, 2),
                    "seed": SEED,
                    "prompt_format": fmt,
                    "max_new_tokens": MAX_NEW,
                }
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
