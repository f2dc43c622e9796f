"""EXPLORATORY: predictions.jsonl -> summary.csv, one row per task x level x length (n, accuracy, s/example)."""

import sys

import pandas as pd

df = pd.read_json(sys.argv[1], lines=True)
out = (
    df.groupby(["task", "level", "length"], sort=True)
    .agg(
        n=("correct", "size"),
        accuracy=("correct", "mean"),
        mean_score=("score", "mean"),
        seconds_per_example=("seconds", "mean"),
        mean_prompt_tokens=("prompt_tokens", "mean"),
        max_new_tokens=("max_new_tokens", "max"),
        seed=("seed", "first"),
    )
    .reset_index()
)
out["in_0.3_0.8"] = out["accuracy"].between(0.3, 0.8)
out = out.round({"accuracy": 3, "mean_score": 3, "seconds_per_example": 1, "mean_prompt_tokens": 0})
if len(sys.argv) > 2:
    out.to_csv(sys.argv[2], index=False)
print(out.to_string(index=False))
