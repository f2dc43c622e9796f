"""The `kvcert` command: certified generation for one prompt and the calibration it uses.

    kvcert generate --model smollm2 --context-file doc.txt --question "Who wrote it?" --budget 0.25 \
        [--max-new-tokens 64] [--calibration FILE|none] [--escalate none|study4|0.1] [--escalate-scope answer|token] \
        [--escalate-signal certificate|agreement] [--draws 2 [--draws-variant independent|split]] \
        [--tolerance 0.1 [--ladder 0.125,0.25,0.5,1]] [--json out.json] [--html out.html]
    kvcert calibrate --model smollm2 [--tasks single_needle,fact_qa | --data file.jsonl] [--lengths 1024] [--n 20] \
        [--budgets 0.25,0.5] [--seed 5000] [--draws 2 [--draws-variant independent|split]] --out calib.json

Bad input (a missing file, an empty context or question, a budget outside (0, 1], a model the loader cannot load, a
prompt past the model's window or one the tokenizer cannot read back, a calibration for another model or policy) is
one line on stderr, `error: <problem>; <fix>`, and exit code 2. The request is checked by
`kvcert.serve.validate.validate_request`, the check `kvcert.generate` runs (same words); the cheap checks run before
the model is loaded. The arguments and their help: `kvcert.serve.cli_parser`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

from kvcert.serve.cli_parser import ESCALATE_CHOICES, build_parser

EXIT_USAGE = 2
# the studies' randomized policy (kvcert.serve.generate.default_policy), without its budget
POLICY_FIELDS = dict(scorer="window_question", design="randomized", tail_fraction=0.75, floor=0.2, score_power=1.0)


class UsageError(Exception):
    """Bad input: the message is `<problem>; <fix>`, printed as one `error:` line."""


def _fail(message: str) -> int:
    print("error: " + " ".join(str(message).split()), file=sys.stderr, flush=True)
    return EXIT_USAGE


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # the library's warnings (no calibration, ...) are for the user: one line, no source location
    print("warning: " + " ".join(str(message).split()), file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- argument checks
def _budget(text: str, what: str = "--budget") -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a number; pass a share of the prompt in (0, 1], e.g. 0.25") from None
    if not 0.0 < value <= 1.0:
        raise UsageError(f"{what} {value:g} is outside (0, 1]; pass the share of the prompt to keep, e.g. 0.25")
    return value


def _floats(text: str, what: str) -> list[float]:
    return [_budget(part, what) for part in text.split(",") if part.strip()]


def _model_name(name: str) -> str:
    """The packaged name for a short name; anything else (a folder, a hub id such as gpt2) goes to the loader as
    given, which refuses what it cannot load in one line (kvcert.hf.loading.ModelLoadError)."""
    from kvcert.serve import ALIASES

    return ALIASES.get(name, name)


def _read_text(path: str, what: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{what} {path} does not exist; pass an existing UTF-8 text file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{what} {path} is not UTF-8 text ({err.reason} at byte {err.start}); convert it") from None
    return text


def _calibration_arg(text: str | None, model_name: str, budget: float):
    """ "auto" (the shipped file, if any), None (--calibration none) or the path of a file that applies to this
    model, the default policy and budget (checked before the model loads; the layer count is checked after)."""
    from kvcert.serve.calibration import Calibration
    from kvcert.serve.generate import default_policy

    if text is None or text == "auto":
        return "auto"
    if text.lower() == "none":
        return None
    path = Path(text).expanduser()
    fix = f"pass a file `kvcert calibrate --model {model_name}` wrote, or --calibration none"
    if not path.is_file():
        raise UsageError(f"calibration file {text} does not exist; {fix}")
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f"{err.msg} at line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else err
        raise UsageError(f"calibration file {text} is not JSON ({where}); {fix}") from None
    cal = Calibration.load(path)  # CalibrationError: JSON but not a calibration file
    why = cal.mismatch(model_name, cal.n_layers, default_policy(budget), budget)
    if why is not None:
        raise UsageError(
            f"calibration file {text} does not apply: {why}; run `kvcert calibrate --model {model_name}` "
            "for this model, or pass --calibration none"
        )
    return text


def _escalate_arg(text: str | None, scope: str = "answer", signal: str = "certificate", draws=None):
    from kvcert.serve.generate import AUTO, STUDY4, Escalation

    if text is None or text.lower() == "none":
        if signal == "agreement":  # asked for a signal and no rate to act on it
            raise UsageError("--escalate-signal agreement needs a rate; pass --escalate 0.2")
        return None  # generate's default since study 5: no escalation unless asked for
    if signal == "agreement" and draws is None:
        raise UsageError("--escalate-signal agreement needs several draws; pass --draws 2")
    if signal == "agreement" and scope != "answer":
        raise UsageError("--escalate-signal agreement scores the whole answer; pass --escalate-scope answer")
    if text.lower() in (STUDY4, AUTO):
        if signal == "agreement":  # study4 is the certificate rule: the agreement needs its rate
            raise UsageError("--escalate-signal agreement needs a rate; pass --escalate 0.2 (study4: the certificate)")
        return text.lower()  # study 4's certificate escalation where a calibration applies ("auto": its old name,
        # which generate still takes with a warning)
    try:
        rate = float(text)
    except ValueError:
        raise UsageError(f"--escalate {text!r} is not a valid value; pass {ESCALATE_CHOICES}") from None
    if not 0.0 < rate < 1.0:
        raise UsageError(f"--escalate {rate:g} is outside (0, 1); pass {ESCALATE_CHOICES}")
    return Escalation(rate=rate, scope=scope, signal=signal)


def _draws_arg(count: str | None, variant: str | None):
    """--draws / --draws-variant -> a kvcert.hf.draws.Draws, or None (one draw); split alone means its 2 rows."""
    from kvcert.hf.draws import Draws

    if count is None:
        return None if variant is None else Draws(count=2, variant=variant)
    n = int(count) if count.strip().isdigit() else None
    if n is None or n < 2:
        fix = "pass --draws 2 (or leave --draws out for one draw)"
        raise UsageError(f"--draws {count}: agreement needs a whole number of draws, at least 2; {fix}")
    if variant == "split" and n != 2:
        raise UsageError(f"--draws {n} with --draws-variant split: the split halves are 2 rows; pass --draws 2")
    return Draws(count=n, variant=variant or "independent")


def _tolerance_args(tolerance: str | None, ladder: str) -> tuple[float | None, tuple[float, ...]]:
    try:
        rungs = tuple(float(x) for x in ladder.split(","))
    except ValueError:
        raise UsageError(
            f"--ladder {ladder!r} is not a comma-separated list of budgets, e.g. 0.125,0.25,0.5,1"
        ) from None
    if any(not 0.0 < b <= 1.0 for b in rungs):
        raise UsageError(f"--ladder {ladder}: every budget must lie in (0, 1], e.g. 0.125,0.25,0.5,1")
    if tolerance is None or tolerance.lower() == "none":
        return None, rungs
    try:
        value = float(tolerance)
    except ValueError:
        raise UsageError(
            f"--tolerance {tolerance!r} is not a number; pass a relative attention error, e.g. 0.1"
        ) from None
    if not value > 0:
        raise UsageError(f"--tolerance {value:g} is not positive; pass a relative attention error, e.g. 0.1")
    return value, rungs


def _writable(path: str | None, flag: str) -> Path | None:
    if path is None:
        return None
    out = Path(path).expanduser()
    if out.is_dir():
        raise UsageError(f"{flag} {path} is a folder; pass a file name")
    return out


def _load(name: str):
    from kvcert.hf.loading import ModelLoadError
    from kvcert.serve import load_model  # kvcert.load_model (looked up here, so that tests can stand in for it)

    try:
        return load_model(name)
    except ModelLoadError as err:
        raise UsageError(str(err)) from None


# ----------------------------------------------------------------------------------------------- generate
def _json_safe(value):
    """NaN and infinities -> None, recursively (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _request_budget(text: str) -> float:
    """--budget as generate's budget=: a number, checked by validate_request (its words: the API's)."""
    from kvcert.serve.validate import validate_request

    try:
        budget: object = float(text)
    except ValueError:
        budget = text  # validate_request refuses it as "not a number"
    try:
        validate_request(budget=budget)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return float(text)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvcert.serve.budget_cli import budget_file_arg
    from kvcert.serve.validate import validate_request

    budget = budget_file_arg(args.budget_file, args.group, args.tolerance) or _request_budget(args.budget)
    context = _read_text(args.context_file, "context file")
    try:  # the API's own check, before the model loads (generate repeats it with the tokenizer)
        validate_request(context=context, question=args.question, max_new_tokens=args.max_new_tokens,
                         answer_prefix=args.answer_prefix)  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err)) from None
    model_name = _model_name(args.model)
    calibration = _calibration_arg(args.calibration, model_name, getattr(budget, "budget", budget))
    draws = _draws_arg(args.draws, args.draws_variant)
    escalate = _escalate_arg(args.escalate, args.escalate_scope, args.escalate_signal, draws)
    tolerance, ladder = _tolerance_args(args.tolerance, args.ladder)
    if escalate is not None and not isinstance(escalate, str) and calibration is None:  # a rate given
        raise UsageError("--escalate needs a calibration (its threshold); drop --calibration none or --escalate")
    json_out, html_out = _writable(args.json, "--json"), _writable(args.html, "--html")

    import torch

    from kvcert.serve.generate import Escalated, generate

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(model_name)

    def stream(event) -> None:
        if isinstance(event, Escalated):  # an answer-scope restart: what was printed is void
            to = "the full cache" if event.budget_to >= 1.0 else f"budget {event.budget_to:g}"
            print(f"\n[restarted with {to}: {event.reason}]", flush=True)
            return
        print(event.text, end="", flush=True)

    started = time.perf_counter()
    try:
        gen = generate(
            model,
            tokenizer,
            context=context,
            question=args.question,
            budget=budget,
            calibration=calibration,
            escalate=escalate,
            max_new_tokens=args.max_new_tokens,
            on_token=stream,
            model_name=model_name,
            seed=args.seed,
            tolerance=tolerance,
            ladder=ladder,
            answer_prefix=args.answer_prefix,
            draws=draws,
        )
    except ValueError as err:  # validate_request, CalibrationError, TaskError, the prompt-length check
        print(flush=True)
        raise UsageError(str(err)) from None
    seconds = time.perf_counter() - started
    # the stream may show a stop string the answer then drops: the answer line is the result
    print()
    print(gen.summary())  # "answer: <text>" first, then what its numbers mean and what to do
    if gen.budget_choice is not None:
        c = gen.budget_choice
        rungs = ", ".join(f"{b}: {e:.3g}" for b, e in c.errors.items())
        print(f"budget from tolerance {c.tolerance:g}: {c.chosen:g} ({c.reason}; probe error per budget {rungs})")
    print(f"({len(gen.steps)} tokens in {seconds:.1f} s, prompt {gen.prompt_tokens} tokens, stopped at {gen.stopped})")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(_json_safe(gen.to_dict()), indent=1, allow_nan=False) + "\n")
        print(f"wrote {json_out}")
    if html_out is not None:
        from kvcert.serve.html import write_html

        # the legend's scale: the threshold the escalation used (the budget's), carried on the generation
        title = f"kvcert generate: {model_name}, answer from {gen.source()}"
        write_html(gen, html_out, title=title, question=args.question)
        print(f"wrote {html_out}")
    return 0


# ----------------------------------------------------------------------------------------------- calibrate
def _examples(args: argparse.Namespace, tokenizer) -> tuple[list, dict]:
    from kvcert.tasks import load_jsonl_examples, make_examples

    if args.data:
        examples = load_jsonl_examples(args.data, n=args.n)
        return examples, dict(file=str(args.data), n=args.n)
    examples = []
    for task in args.task_list:
        for length in args.length_list:
            examples += make_examples(task, args.n, length, tokenizer, seed=args.seed)
    seeds = f"{args.seed} (make_examples seed; examples 0-{args.n - 1} per task and length)"
    data = dict(tasks=args.task_list, lengths=args.length_list, seeds=seeds, source="paul_graham", n_per_task=args.n)
    return examples, data


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvcert.tasks import ALL_TASKS as TASKS

    budgets = _floats(args.budgets, "--budgets")
    if not budgets:
        raise UsageError("--budgets is empty; pass budgets in (0, 1], e.g. 0.25,0.5")
    if args.n < 2:
        raise UsageError(f"--n {args.n} is too few; the fit splits the examples in two halves, pass at least 2")
    if args.data:
        if not Path(args.data).expanduser().is_file():
            raise UsageError(f"data file {args.data} does not exist; pass a JSON-lines file (one example a line)")
    else:
        args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = [t for t in args.task_list if t not in TASKS]
        if unknown or not args.task_list:
            raise UsageError(f"unknown task(s) {', '.join(unknown) or '(none)'}; use some of {', '.join(TASKS)}")
        try:
            args.length_list = [int(x) for x in args.lengths.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--lengths {args.lengths!r} is not a list of integers; pass e.g. 1024,2048") from None
        if not args.length_list or min(args.length_list) < 1:
            raise UsageError(f"--lengths {args.lengths!r} needs positive token counts; pass e.g. 1024")
    out = _writable(args.out, "--out")
    draws = _draws_arg(args.draws, args.draws_variant)
    model_name = _model_name(args.model)

    import torch

    from kvcert.hf.loading import EMBEDDED_MODELS, embedded_prompt_format
    from kvcert.serve.calibration import calibrate, describe

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(model_name)
    try:
        examples, data = _examples(args, tokenizer)
    except ValueError as err:  # TaskError: a bad row, an unbuildable task
        raise UsageError(str(err)) from None
    if len(examples) < 2:
        raise UsageError(f"only {len(examples)} example(s); the fit splits them in two halves, pass at least 2")
    fmt = embedded_prompt_format(model_name) if model_name in EMBEDDED_MODELS else "auto"
    print(f"calibrating {model_name} on {len(examples)} examples at budgets {', '.join(f'{b:g}' for b in budgets)}")
    started = time.perf_counter()
    cal = calibrate(
        model,
        tokenizer,
        model_name,
        examples,
        policy_fields=dict(POLICY_FIELDS),
        budgets=budgets,
        data=data,
        prompt_format=fmt,
        work_dir=args.work_dir,
        draws=draws,
    )
    cal.data["wall_s"] = round(time.perf_counter() - started)
    cal.save(out)
    print(describe(cal))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from kvcert.serve.calibration import CalibrationError

    args = build_parser().parse_args(argv)
    from kvcert.report import cmd_report
    from kvcert.serve.budget_cli import cmd_calibrate_budget

    commands = {"generate": cmd_generate, "calibrate": cmd_calibrate, "calibrate-budget": cmd_calibrate_budget}
    command = {**commands, "report": cmd_report}[args.command]
    with warnings.catch_warnings():
        warnings.showwarning = _print_warning
        try:
            return command(args)
        except (UsageError, CalibrationError) as err:
            return _fail(str(err))


__all__ = ["EXIT_USAGE", "UsageError", "build_parser", "cmd_calibrate", "cmd_generate", "main"]
