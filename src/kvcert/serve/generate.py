"""Certified generation for one prompt: `generate` reads the prompt once, keeps a compressed cache (serving mode:
the full cache never exists), decodes greedily and gives every token a calibrated certificate. It escalates only
when asked (`escalate=None` by default, as study 5's pre-registered rule decided: no per-answer signal beat
confidence inside one kind of prompt). `escalate="study4"` applies study 4's rule (`STUDY4_ESCALATION`: when the
answer's largest certificate so far crosses the calibration's threshold for a 20% escalation rate, the answer is
discarded and decoded again with the full cache); any `Escalation` or `RateEscalator` sets another.

    from kvcert import generate, load_model
    model, tokenizer = load_model("smollm2")  # or "gemma3", a folder, a hub id
    out = generate(model, tokenizer, context=document, question="Who wrote it?", budget=0.25)
    print(out.summary())  # the answer (out.answer), then what its certificate means and what to do with it

Token i's certificate is that of the forward that predicted it (`kvcert.serve.certificate`). The first token after
a prompt is read comes from exact attention over the whole prompt (the policy compresses after reading it), so its
certificate is 0; so is every token decoded with the full cache. A token is `trusted` when a calibration applies to
the model, the policy and the budget and its certificate is finite; without one, `generate` warns once and marks
every token untrusted: an uncalibrated radius is never presented as a bound. A full-cache generation (`policy=FULL`)
needs no calibration: its certificates are exactly 0 and every token is trusted, without a warning.

`draws=2` decodes several draws of the policy from the same read (draw 0's answer is the answer, the others report
their agreement with it: `Generation.agreement`, `Escalation(signal="agreement")`), and `escalate=` also takes a
`RateEscalator`, which holds an escalation rate over a stream of calls (docs/generate.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvcert.policy import FULL, Policy
from kvcert.serve.budget_file import CalibratedBudget, resolve_budget
from kvcert.serve.calibration import Calibration, CalibrationError, shipped
from kvcert.serve.escalator import RateEscalator
from kvcert.serve.generation import EXACT, REFERENCE_RATE, Generation
from kvcert.serve.probe import DEFAULT_LADDER, choose_rung, summarize
from kvcert.serve.stream import (
    AUTO,
    DEFAULT_ESCALATION,
    SCOPES,
    SIGNALS,
    STUDY4,
    STUDY4_ESCALATION,
    Escalated,
    Escalation,
    Token,
    _escalate_to,
    _Stream,
    answer_confidence,
    reference_thresholds,
    resolve_rule,
)

if TYPE_CHECKING:
    from kvcert.hf.draws import Draws

__all__ = [
    "AUTO",
    "DEFAULT_ESCALATION",
    "SCOPES",
    "STUDY4",
    "STUDY4_ESCALATION",
    "SIGNALS",
    "Escalated",
    "Escalation",
    "Generation",
    "RateEscalator",
    "Token",
    "generate",
]

DEFAULT_MAX_NEW_TOKENS = 64
MESSAGES_WINDOW = 32  # tokens at the end of a chat prompt that play the question (see build_prompt)
_WARNED: set[tuple] = set()


def default_policy(budget: float) -> Policy:
    """The studies' randomized policy: question-aware window scorer, tail fraction 0.75, floor 0.2."""
    return Policy(scorer="window_question", design="randomized", budget=budget, tail_fraction=0.75, floor=0.2)


def _warn_once(key: tuple, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def resolve_calibration(
    calibration, model_name: str | None, n_layers: int, policy: Policy, *, chosen_budget: bool = False
) -> tuple[Calibration | None, str | None]:
    """(the calibration to use or None, its label). "auto": the shipped file of a packaged model; a path or a
    Calibration must match the model, the policy and the budget (CalibrationError otherwise; with chosen_budget, a
    budget picked from a tolerance, a file that only misses that budget is set aside with the usual warning)."""
    label = None
    if policy.is_full:  # the full cache is exact: nothing to calibrate, every certificate is 0 and every token trusted
        return None, EXACT
    if calibration == "auto":
        cal = shipped(model_name) if model_name else None
        if cal is not None:
            label = f"{model_name}: shipped"
            if cal.mismatch(model_name, n_layers, policy, policy.budget) is not None:
                cal = None
    elif calibration is None:
        cal = None
    else:
        if isinstance(calibration, Calibration):
            cal, label = calibration, f"{calibration.model}: given"
        else:
            cal, label = Calibration.load(calibration), f"{Path(calibration).name}"
        why = cal.mismatch(model_name, n_layers, policy, policy.budget)
        if why is not None and chosen_budget and cal.mismatch(model_name, n_layers, policy, min(cal.budgets)) is None:
            why, cal = None, None
        if why is not None:
            raise CalibrationError(
                f"calibration {label} does not apply: {why}; run `kvcert calibrate` for this model and policy"
            )
    if cal is None:
        _warn_once(
            (model_name, policy),
            f"kvcert: no calibration for model {model_name or '(unnamed)'} with {policy.label}: every token is "
            "marked untrusted (run `kvcert calibrate` to fit one)",
        )
        return None, None
    return cal, label


def build_prompt(tokenizer, *, context, question, messages, prompt_format: str, answer_prefix: str | None = None):
    """(input ids, index where the question starts, stop strings). answer_prefix: the start of the answer the model
    continues (a base model needs one, e.g. "The access code is"; the answer returned excludes it); None: the
    format's default (`kvcert.tasks.render.default_answer_prefix`: "Answer:" in the plain base-model format, else
    none); "": none."""
    from kvcert.tasks import Example, render
    from kvcert.tasks.render import default_answer_prefix, end_of_turn_strings

    if messages is not None:
        if context is not None or question is not None:
            raise ValueError("pass either messages= or context= and question=, not both")
        if answer_prefix:
            raise ValueError("answer_prefix= goes with context= and question= (end the messages yourself)")
        if not messages or not isinstance(messages[-1], dict) or "content" not in messages[-1]:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # a conversation has no context / question split: the last MESSAGES_WINDOW tokens (the end of the last turn
        # and the generation prompt) play the question, the observation window SnapKV-style scorers read
        return ids, max(1, len(ids) - MESSAGES_WINDOW), end_of_turn_strings(tokenizer)
    if context is None or question is None:
        raise ValueError("pass context= and question= (or messages=)")
    if answer_prefix is None:
        answer_prefix = default_answer_prefix(tokenizer, prompt_format)
    example = Example(
        id="prompt",
        task="user",
        context=context,
        question=question,
        answers=(),
        depth=math.nan,
        metric="em",
        target_tokens=0,
        answer_prefix=answer_prefix,
    )
    rendered = render(example, tokenizer, prompt_format)
    return rendered.input_ids, rendered.question_start, rendered.stop_strings


def full_cache_bytes(model, prompt_tokens: int, max_new_tokens: int) -> int:
    """Bytes this engine's full cache holds for the prompt and max_new_tokens: keys and values of every token in
    every layer plus the one slot each layer reserves beyond the last token, in the model's dtype. It is exactly
    what `generate(..., policy=FULL)` reports as kv_bytes, so a compressed cache is compared with the full cache of
    the same engine (a sliding-window layer keeps every token here too; its mask hides those outside the window)."""
    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = next(model.parameters()).element_size()
    slots = prompt_tokens + max_new_tokens + 1  # kvcert.hf.prefill reserves max_new_tokens + 1 slots per layer
    return 2 * n_kv * head_dim * size * slots * int(cfg.num_hidden_layers)


def kv_bytes(batch) -> int:
    """Bytes of the keys and values a CompressedBatch holds: every bucket and layer, padding (a head-wise allocation
    pads every head to the widest) and the slots reserved for the tokens still to come included; after a decode
    that re-compressed (Policy.recompress_every), the most it held at any re-compression."""
    return max(batch.state.held_bytes(), batch.state.peak_bytes)


def answer_kv_bytes(batch, rows: list[Policy], prompt_tokens: int, question_start: int, opts) -> int:
    """`kv_bytes` of one row; of several draws (kvcert.hf.draws), the KV they hold together when the positions
    several keep are stored once (`union_kv_bytes`), each row with the answer slots `kv_bytes` reserves for one."""
    if len(rows) == 1:
        return kv_bytes(batch)
    from kvcert.hf.draws import union_kv_bytes

    read = prompt_tokens if rows[0].compress_after == "prompt" else question_start  # what the compression saw
    slots = prompt_tokens - read + opts.max_new_tokens + 1  # as kvcert.hf.compressed_batch reserves per row
    return union_kv_bytes(batch, list(range(len(rows))), {i: slots for i in range(len(rows))})


@torch.no_grad()
def generate(
    model,
    tokenizer,
    *,
    context: str | None = None,
    question: str | None = None,
    messages: list[dict] | None = None,
    budget: float | str | CalibratedBudget = 0.25,
    policy: Policy | None = None,
    calibration="auto",
    escalate: Escalation | RateEscalator | str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    on_token: Callable[[Token | Escalated], None] | None = None,
    prompt_format: str | None = None,
    model_name: str | None = None,
    seed: int = 0,
    probe: bool = True,
    tolerance: float | None = None,
    ladder: tuple[float, ...] = DEFAULT_LADDER,
    answer_prefix: str | None = None,
    draws: Draws | int | None = None,
) -> Generation:
    """Greedy generation from a compressed cache with a per-token certificate (see the module docstring).

    policy: default the studies' randomized policy at `budget` (`default_policy`); calibration: "auto" (the shipped
    file of a packaged model), a path, a Calibration, or None; escalate: None (the default: never), "study4" (study
    4's certificate rule, `STUDY4_ESCALATION`, where a calibration gives its threshold) or an Escalation;
    on_token(token) is called for each token as it is produced (streaming), and with the Escalated event when an
    answer-scope escalation restarts the answer (the tokens streamed before it are void); prompt_format: chat / plain /
    auto (default: the packaged model's, else auto); seed: the design's random draws; probe: measure the prefill probe
    (`Generation.probe`); tolerance: choose the budget from `ladder` by the probe (kvcert.serve.probe; `budget` is
    then ignored and the chosen budget reported in `Generation.budget_choice`); answer_prefix: text the answer starts
    with, read as part of the prompt and not returned; None (the default): "Answer:" for a model without a chat
    template (plain format: asked a bare question, a base model such as gemma3-270m ends its turn at once), none in
    the chat format; "": none. An empty answer is warned about, naming answer_prefix=. Bad input (an empty context
    or question, a budget outside (0, 1], text the tokenizer cannot read back) is one ValueError naming the fix
    (`kvcert.serve.validate`). draws: None (one draw), an int R (R independent draws) or a kvcert.hf.draws.Draws:
    the policy's draws decoded as rows of one batch from one read, draw 0's answer the answer and the others fed
    its tokens (`Generation.agreement`; docs/generate.md). escalate= also takes a RateEscalator, asked once per
    answer with the answer's signal (the answer restarts with the full cache when it says so). budget= also takes a
    `kvcert calibrate-budget` file or a CalibratedBudget (kvcert.serve.budget_file; summary() states its guarantee)."""
    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading
    from kvcert.hf.decode import answer_length, eos_ids
    from kvcert.hf.draws import agreement_of, answer_end, as_draws, draw_policies
    from kvcert.serve.validate import validate_request, warn_empty_answer
    from kvcert.tasks.render import default_answer_prefix

    budget, policy, guarantee = resolve_budget(budget, policy, model, tolerance)  # a budget file: its budget, guarantee
    validate_request(context=context, question=question, budget=None if policy else budget, messages=messages,
                     max_new_tokens=max_new_tokens, answer_prefix=answer_prefix, tokenizer=tokenizer)  # fmt: skip
    model_name = model_name or getattr(model, "kvcert_name", None)
    policy = policy or default_policy(budget)
    draws = as_draws(draws)
    if draws is not None:
        draw_policies(policy, draws)  # refuses, before any read, a policy with no random draws to repeat
    if prompt_format is None:
        prompt_format = "auto"
        if model_name:
            from kvcert.hf.loading import EMBEDDED_MODELS, embedded_prompt_format

            if model_name in EMBEDDED_MODELS:
                prompt_format = embedded_prompt_format(model_name)
    if answer_prefix is None and messages is None:
        answer_prefix = default_answer_prefix(tokenizer, prompt_format)
    ids, qs, stops = build_prompt(
        tokenizer,
        context=context,
        question=question,
        messages=messages,
        prompt_format=prompt_format,
        answer_prefix=answer_prefix,
    )
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and len(ids) + max_new_tokens > window:
        raise ValueError(
            f"the prompt has {len(ids)} tokens and {max_new_tokens} new tokens would end past the model's window of "
            f"{window}: shorten the context or lower max_new_tokens"
        )
    n_layers = int(model.config.num_hidden_layers)
    example_id = f"kvcert-generate-{seed}"
    choice, first_batch = None, None
    if tolerance is not None:  # one read of the prompt for every rung, the chosen one's cache kept (not with draws)
        once = (
            DecodeOptions(max_new_tokens=max_new_tokens, stop_strings=tuple(stops), oracle=False)
            if draws is None
            else None
        )
        choice, first_batch = choose_rung(model, Prompt(input_ids=ids, question_start=qs, example_id=example_id),
                                             policy, tolerance, ladder, once)  # fmt: skip
        policy = FULL if choice.chosen >= 1.0 else Policy(**{**asdict(policy), "budget": choice.chosen})
    cal, cal_label = resolve_calibration(calibration, model_name, n_layers, policy, chosen_budget=choice is not None)
    reduction = cal.reduction if cal is not None else "max"
    escalate, threshold, escalator = resolve_rule(escalate, cal, policy, draws)
    reference, agreement_reference = reference_thresholds(cal, policy, draws, REFERENCE_RATE)
    stream = _Stream(tokenizer, cal, reduction, escalate, threshold, on_token, n_layers, seed)
    current, kv_held, stopped, probe_result, agreement, drew = policy, 0, "max_new_tokens", None, None, None
    eos = eos_ids(model, tokenizer)
    why = stream.random_restart(current)
    if why is not None:  # drawn before anything is decoded: the answer goes straight to the larger budget
        current = _escalate_to(stream, escalate, current, why, kept=0, reread=0)
    while True:
        generated = [t.id for t in stream.steps]
        opts = DecodeOptions(
            max_new_tokens=max_new_tokens - len(generated),
            stop_strings=tuple(stops),
            oracle=False,
            certificate=not current.is_full,
        )
        prompt = Prompt(input_ids=ids + generated, question_start=qs, example_id=example_id)
        measure = (probe or (escalate is not None and escalate.signal in ("probe", "combined"))) and not current.is_full
        rows, follow = [current], None
        if draws is not None and not current.is_full and not stream.escalations:  # the answer's first cache only
            (rows, follow), drew = draw_policies(current, draws), draws
        if first_batch is not None and not generated and rows == first_batch.policies:
            batch, first_batch = first_batch, None  # tolerance='s read already holds this cache
        else:
            batch = compress_while_reading(model, prompt, rows, opts, probe=measure)
        kv_held = max(kv_held, answer_kv_bytes(batch, rows, len(prompt.input_ids), qs, opts))
        stream.probe_error = math.nan
        if measure:
            found = summarize(batch.probes[0], current.budget, certified=current.has_certificate,
                              multipliers=stream.multipliers, reduction=reduction,
                              risk_model=cal.probe_risk if cal is not None else None)  # fmt: skip
            stream.probe_error = found.error
            probe_result = probe_result or found
        trigger = stream.segment(batch, opts, current, follow)
        kv_held = max(kv_held, answer_kv_bytes(batch, rows, len(prompt.input_ids), qs, opts))  # re-compressions
        if follow:  # the draws' agreement about draw 0's answer (as far as it was decoded)
            ends = answer_end(tokenizer, eos, tuple(stops), stream.results[0])  # answers compared, not end tokens
            agreement = agreement_of(stream.results[0], stream.results[1:], ends)
        if trigger is None:
            n_answer = answer_length(tokenizer, [t.id for t in stream.steps], eos, tuple(stops))[0]
            why = stream.after_answer(current, agreement if follow else None, n_answer, escalator)
            if why is None:
                break
            trigger = 0, why
        at, why = trigger
        kept = 0 if stream.answer_scope else len(generated) + at
        current = _escalate_to(stream, escalate, current, why, kept=kept, reread=len(ids) + kept)
    all_tokens = [t.id for t in stream.steps]
    n_answer, text = answer_length(tokenizer, all_tokens, eos, tuple(stops))
    if n_answer < len(all_tokens):
        stopped = "eos" if all_tokens[n_answer] in eos else "stop string"
    # the first token is read exactly with the prompt, by a prompt-time policy or the full cache (an escalation
    # changes the budget, never when the policy compresses)
    exact = policy.compress_after == "prompt" or bool(stream.steps) and stream.steps[0].budget >= 1.0
    confidence = answer_confidence([t.logprob for t in stream.steps], n_answer, first_exact=exact)
    del stream.steps[n_answer:]
    if not text.strip():
        warn_empty_answer(stopped, answer_prefix)
    if escalator is not None:  # the rule as the escalator applied it to this answer (None: it was not asked)
        threshold, escalate = None, None
        if stream.reading:
            threshold = stream.reading["threshold"]
            escalate = Escalation(signal=escalator.signal, threshold=threshold, rate=escalator.rate)
    return Generation(
        text=text,
        steps=stream.steps,
        escalations=stream.escalations,
        kv_bytes=kv_held,
        full_kv_bytes=full_cache_bytes(model, len(ids), max_new_tokens),
        prompt_tokens=len(ids),
        policy=policy,
        calibration=cal_label,
        reduction=reduction,
        stopped=stopped,
        probe=probe_result if probe else None,
        budget_choice=choice,
        answer_prefix=answer_prefix or "",
        escalation=escalate,
        threshold=threshold,
        draws=drew,
        agreement=agreement,
        confidence=confidence,
        escalator=None if escalator is None else _reading(escalator, stream.reading),
        reference_threshold=reference,
        agreement_reference=agreement_reference,
        guarantee=guarantee,
    )


def _reading(escalator: RateEscalator, reading: dict | None) -> dict:
    """This answer's reading of the escalator (decided: whether it was asked; not for an answer it could not
    restart) and its counts so far (the realized rate the summary reports)."""
    asked = dict(decided=True, **reading) if reading else dict(decided=False, value=None, threshold=None)
    return {**asked, "escalated": bool(reading and reading["escalated"]), "signal": escalator.signal,
            "answers": escalator.seen, "escalations": escalator.escalated, "rate": escalator.rate}  # fmt: skip
