"""The kvpress side of `make kvpress-check`: run inside .venv-kvpress (requirements/kvpress.lock: kvpress 0.5.5,
transformers 5.2), never imported by kvcert (it imports kvpress, not kvcert).

    .venv-kvpress/bin/python src/kvcert/bench/kvpress_side.py PROMPTS.json OUT_DIR
    .venv-kvpress/bin/python src/kvcert/bench/kvpress_side.py --time SPEED_PROMPTS.json OUT_DIR   # kvpress_speed

PROMPTS.json (written by kvcert.bench.kvpress_check): the model folder, the presses, max_new_tokens, and the prompts
(token ids, question start, the kept count per prompt). For each prompt and press the context [0, question_start)
is prefilled under the press (as kvpress's pipeline does), the question is read through the compressed cache and
the answer decoded greedily (kvpress's `generate_answer`: positions continue the uncompressed count). The kept
positions are recovered from the compressed keys themselves (each kept key is an exact copy of one context key),
so they are what kvpress kept, whatever its code path. Writes OUT_DIR/<press>.npz: kept_<i> (layers, Hkv, kept)
int32 per prompt i, answers (prompts, max_new_tokens) int64 padded with -1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from kvpress import (
    CriticalKVPress,
    ExpectedAttentionPress,
    KnormPress,
    ObservedAttentionPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

PRESSES = {
    "SnapKVPress": lambda: SnapKVPress(),
    "StreamingLLMPress": lambda: StreamingLLMPress(),
    "KnormPress": lambda: KnormPress(),
    "TOVAPress": lambda: TOVAPress(),
    "ObservedAttentionPress": lambda: ObservedAttentionPress(),
    "ExpectedAttentionPress": lambda: ExpectedAttentionPress(),
    "CriticalKVPress(SnapKVPress)": lambda: CriticalKVPress(SnapKVPress()),
    "RandomPress": lambda: RandomPress(),
}
EAGER = {"ObservedAttentionPress"}  # reads the attention weights, which only eager attention returns


def kept_positions(full: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """(Hkv, m) sorted positions of the kept keys (Hkv, m, d) among the full keys (Hkv, n, d): exact copies."""
    dist = torch.cdist(kept.double(), full.double(), compute_mode="donot_use_mm_for_euclid_dist")  # (Hkv, m, n)
    best = dist.min(-1)
    if float(best.values.max()) > 0:
        raise RuntimeError("a kept key is no exact copy of a context key")
    return best.indices.sort(-1).values


def run_press(model, name: str, prompts: list[dict], max_new_tokens: int) -> tuple[list[np.ndarray], np.ndarray]:
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    kept_all, answers = [], np.full((len(prompts), max_new_tokens), -1, dtype=np.int64)
    for p_i, p in enumerate(prompts):
        ids = torch.tensor([p["input_ids"]])
        qs = p["question_start"]
        press = PRESSES[name]()
        press.compression_ratio = p["compression_ratio"]  # int(qs * (1 - ratio)) == the kept count kvcert keeps
        seen: dict[int, torch.Tensor] = {}
        compress = press.compress

        def recording(module, hidden_states, keys, values, attentions, kwargs, _compress=compress, _seen=seen):
            new_keys, new_values = _compress(module, hidden_states, keys, values, attentions, kwargs)
            _seen[module.layer_idx] = kept_positions(keys[0], new_keys[0])
            return new_keys, new_values

        press.compress = recording
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model.model(input_ids=ids[:, :qs], past_key_values=cache)
        kept_all.append(torch.stack([seen[i] for i in range(len(seen))]).numpy().astype(np.int32))
        with torch.no_grad():  # kvpress's generate_answer: the question at the uncompressed positions, then greedy
            position = torch.arange(qs, ids.shape[1])[None]
            out = model(input_ids=ids[:, qs:], past_key_values=cache, position_ids=position, logits_to_keep=1)
            token = out.logits[0, -1].argmax()
            for step in range(max_new_tokens):
                answers[p_i, step] = int(token)
                if int(token) in eos or step == max_new_tokens - 1:
                    break
                out = model(
                    input_ids=token[None, None], past_key_values=cache, position_ids=position[:, -1:] + 1 + step
                )
                token = out.logits[0, -1].argmax()
    return kept_all, answers


def answer_seconds(model, ids: torch.Tensor, qs: int, press, max_new_tokens: int) -> float:
    """Wall seconds of one configuration on one prompt as kvpress's pipeline runs it: the context prefilled under
    the press (None: the full cache), the question read through the cache, max_new_tokens greedy tokens (no EOS
    stop, so every configuration decodes the same number of tokens)."""
    t0 = time.perf_counter()
    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            model.model(input_ids=ids[:, :qs], past_key_values=cache)
        else:
            with press(model):
                model.model(input_ids=ids[:, :qs], past_key_values=cache)
        position = torch.arange(qs, ids.shape[1])[None]
        out = model(input_ids=ids[:, qs:], past_key_values=cache, position_ids=position, logits_to_keep=1)
        token = out.logits[0, -1].argmax()
        for step in range(max_new_tokens - 1):
            out = model(input_ids=token[None, None], past_key_values=cache, position_ids=position[:, -1:] + 1 + step)
            token = out.logits[0, -1].argmax()
    return time.perf_counter() - t0


def time_configurations(spec: dict, out: Path) -> None:
    """kvcert.bench.kvpress_speed's kvpress side: per prompt, the seconds of the full cache plus every press at every
    kept share, each configuration on its own -> OUT_DIR/kvpress_times.json."""
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    first = spec["prompts"][0]
    answer_seconds(model, torch.tensor([first["input_ids"]]), first["question_start"], None, 2)  # warm-up
    per_prompt = []
    for p in spec["prompts"]:
        ids, qs = torch.tensor([p["input_ids"]]), p["question_start"]
        total = answer_seconds(model, ids, qs, None, spec["max_new_tokens"])
        for keep in spec["keep"]:
            for name in spec["presses"]:
                press = PRESSES[name]()
                press.compression_ratio = p["compression_ratios"][keep]
                total += answer_seconds(model, ids, qs, press, spec["max_new_tokens"])
        per_prompt.append(total)
    (out / "kvpress_times.json").write_text(json.dumps({"per_prompt_s": per_prompt}))


def _set_head_dim(config) -> None:
    """CriticalKVPress reads `module.config.head_dim`, which transformers 5.2's Qwen2Config does not define (its
    attention falls back to hidden_size // num_attention_heads, as LlamaConfig's default does): set that value."""
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads


def main(argv: list[str]) -> int:
    timing = argv[0] == "--time"
    argv = argv[1:] if timing else argv
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    if timing:
        time_configurations(spec, out)
        return 0
    for name in spec["presses"]:
        t0 = time.perf_counter()
        attn = "eager" if name in EAGER else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation=attn)
        model.eval()
        _set_head_dim(model.config)
        kept, answers = run_press(model, name, spec["prompts"], spec["max_new_tokens"])
        np.savez(out / f"{name}.npz", answers=answers, **{f"kept_{i}": k for i, k in enumerate(kept)})
        print(
            f"kvpress {name}: {len(kept)} prompts, (layers, Hkv, kept) {kept[0].shape} on prompt 0, "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
