"""Study 5's records (preregistration/study5/PLAN.md): per example, one read of the prompt (serving mode, as
`kvcert.generate`) for the full cache and, at each budget, every row the study's signals need, decoded as one batch:

- draws 0..R_max-1 of the studies' randomized policy (seeds 0..R_max-1), each decoding its own greedy answer (the
  majority answer of R draws is read off them);
- followers 1..R_max-1: the same draws fed draw 0's tokens (teacher forcing, kvcert.hf.draws), giving the
  log-probability each draw assigns draw 0's answer and its own greedy choice at every step;
- split halves 0 and 1 of draw 0's tail (Policy.half), also fed draw 0's tokens.

Greedy decoding is deterministic and an escalation yields exactly the full cache's greedy answer, so these rows give
every escalation policy's answer offline (kvcert.studies.study5.analysis). One row per (example, budget); rows are
appended to answers.jsonl as each example finishes (fsync'ed) and a rerun skips the examples already there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvcert.studies.study5.common import MAX_DRAWS, MAX_NEW_TOKENS


def _policies(budgets: Sequence[float], r_max: int):
    """[FULL] + per budget: draws 0..r_max-1, followers 1..r_max-1, halves 0 and 1; the follow map; the index of
    each budget's rows."""
    from kvcert.policy import FULL
    from kvcert.serve.generate import default_policy

    policies, follow, where = [FULL], {}, {}
    for budget in budgets:
        base = default_policy(float(budget))
        draws = list(range(len(policies), len(policies) + r_max))
        policies += [replace(base, seed=r) for r in range(r_max)]
        followers = list(range(len(policies), len(policies) + r_max - 1))
        policies += [replace(base, seed=r) for r in range(1, r_max)]
        halves = [len(policies), len(policies) + 1]
        policies += [replace(base, half=0), replace(base, half=1)]
        follow.update({i: draws[0] for i in followers + halves})
        where[float(budget)] = dict(draws=draws, followers=followers, halves=halves)
    return policies, follow, where


def _certificates(out, cal, n: int) -> list[float]:
    """Study 4's token certificates of an answer (the first token, read with the full prompt, counts 0)."""
    import torch

    from kvcert.serve.certificate import token_certificate

    certs = [0.0]
    if n > 1 and "variance" in out.stats:
        stats = {k: torch.from_numpy(out.stats[k][: n - 1]) for k in ("variance", "trace_c2", "out_norm")}
        multipliers = cal.multiplier_tensor() if cal is not None else None
        certs += token_certificate(stats, multipliers, cal.reduction if cal is not None else "max")[0].tolist()
    return certs[:n]


def example_rows(model, tokenizer, example, budgets: Sequence[float], *, model_name: str, r_max: int = MAX_DRAWS):
    """One read, one batched decode, one row per budget (see the module doc)."""
    from kvcert.core import agreement
    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading
    from kvcert.hf.draws import union_kv_bytes
    from kvcert.hf.loading import EMBEDDED_MODELS, embedded_prompt_format
    from kvcert.serve.generate import full_cache_bytes, resolve_calibration
    from kvcert.tasks import render, score

    fmt = embedded_prompt_format(model_name) if model_name in EMBEDDED_MODELS else "auto"
    rendered = render(example, tokenizer, fmt)  # the task's own prompt, its answer prefix included (as study 4)
    ids, qs, stops = list(rendered.input_ids), int(rendered.question_start), tuple(rendered.stop_strings)
    policies, follow, where = _policies(budgets, r_max)
    opts = DecodeOptions(max_new_tokens=MAX_NEW_TOKENS, stop_strings=stops, oracle=False, certificate=True)
    prompt = Prompt(input_ids=ids, question_start=qs, example_id="kvcert-generate-0")  # kvcert.generate's draws
    batch = compress_while_reading(model, prompt, policies, opts, probe=False)
    results = batch.decode(opts, tokenizer, follow=follow)
    full = results[0]
    full_correct = bool(score(full.answer, example)[1])
    slots = MAX_NEW_TOKENS + 1  # each row reserves its answer's slots (kvcert.hf.prefill), as kv_bytes counts them
    n_layers = int(model.config.num_hidden_layers)
    rows = []
    for budget, at in where.items():
        lead = results[at["draws"][0]]
        n = lead.n_answer
        span = agreement.scored_span(n, len(lead.tokens), first_from_prefill=True)
        end = span.stop
        fol = [results[i] for i in at["followers"]]
        halves = [results[i] for i in at["halves"]]
        cal, label = resolve_calibration("auto", model_name, n_layers, lead.policy)
        certs = _certificates(lead, cal, n)
        finite = [c for c in certs if math.isfinite(c)]

        def kv(indices: list[int]) -> int:
            return int(union_kv_bytes(batch, indices, {i: slots for i in indices}))

        row = dict(
            example_id=example.id,
            task=example.task,
            context_tokens=int(example.target_tokens),
            budget=float(budget),
            prompt_tokens=len(ids),
            full_correct=full_correct,
            full_answer=full.answer,
            full_kv_bytes=int(full_cache_bytes(model, len(ids), MAX_NEW_TOKENS)),
            answer=lead.answer,
            correct=bool(score(lead.answer, example)[1]),
            n_answer=n,
            tokens=list(lead.tokens[:end]),
            logprobs=list(lead.logprobs[:end]),
            certificate=max(finite) if finite else math.nan,
            token_certificates=certs,
            calibration=label,
            confidence=agreement.confidence(lead.logprobs, span),
            draw_answers=[results[i].answer for i in at["draws"]],
            draw_correct=[bool(score(results[i].answer, example)[1]) for i in at["draws"]],
            follower_logprobs=[list(f.logprobs[:end]) for f in fol],
            follower_tokens=[list(f.own_tokens[:end]) for f in fol],
            half_logprobs=[list(h.logprobs[:end]) for h in halves],
            half_tokens=[list(h.own_tokens[:end]) for h in halves],
            kv_one=kv(at["draws"][:1]),
            kv_split=kv(at["draws"][:1] + at["halves"]),
        )
        for r in range(2, r_max + 1):
            row[f"kv_r{r}"] = kv(at["draws"][:r])
            row[f"disagreement_r{r}"] = agreement.disagreement(lead.logprobs, [f.logprobs for f in fol[: r - 1]], span)
            row[f"differs_r{r}"] = agreement.differs(lead.tokens, [f.own_tokens for f in fol[: r - 1]], span)
        row["disagreement_split"] = agreement.disagreement(lead.logprobs, [h.logprobs for h in halves], span)
        row["differs_split"] = agreement.differs(lead.tokens, [h.own_tokens for h in halves], span)
        rows.append(row)
    return rows


def collect(
    model, tokenizer, examples, budgets: Sequence[float], out_dir, *, model_name: str, r_max: int = MAX_DRAWS, log=print
) -> Path:
    """Every example not yet in out_dir/answers.jsonl, appended as it finishes; returns the file."""
    from kvcert.studies.study4.collect import _append, _done

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "answers.jsonl"
    done = _done(path)
    todo = [e for e in examples if e.id not in done]
    started = time.perf_counter()
    for i, example in enumerate(todo):
        _append(path, example_rows(model, tokenizer, example, budgets, model_name=model_name, r_max=r_max))
        if log is not None:
            log(f"  {i + 1}/{len(todo)} {example.id} ({time.perf_counter() - started:.0f} s)")
    return path
