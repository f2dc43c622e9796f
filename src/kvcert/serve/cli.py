"""The `kvcert` command: certified generation for one prompt and the calibration it uses.

    kvcert generate --model smollm2 --context-file doc.txt --question "Who wrote it?" --budget 0.25 \
        [--max-new-tokens 64] [--calibration FILE|none] [--escalate auto|0.1|none] [--escalate-scope answer|token] \
        [--tolerance 0.1 [--ladder 0.125,0.25,0.5,1]] [--json out.json] [--html out.html]
    kvcert calibrate --model smollm2 [--tasks single_needle,fact_qa | --data file.jsonl] [--lengths 1024] [--n 20] \
        [--budgets 0.25,0.5] [--seed 5000] --out calib.json

Bad input (a missing file, an unknown model, a budget outside (0, 1], a prompt past the model's window, a
calibration for another model or policy) is one line on stderr, `error: <problem>; <fix>`, and exit code 2; the
cheap checks run before the model is loaded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

EXIT_USAGE = 2
DEFAULT_TASKS = "single_needle,multikey_needle,fact_qa"
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
    """The packaged name for a short name; refuses a name that is neither packaged, a folder nor a hub id."""
    from kvcert.hf.loading import EMBEDDED_MODELS
    from kvcert.serve import ALIASES

    name = ALIASES.get(name, name)
    if name in EMBEDDED_MODELS:
        return name
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"model {name!r} is a file; pass the model's folder (the one with config.json)")
        return name
    if name.count("/") == 1 and not name.startswith(("/", ".", "~")):
        return name  # a hub id: the loader decides (and says how to download it)
    known = ", ".join([*EMBEDDED_MODELS, *ALIASES])
    raise UsageError(f"unknown model {name!r} (not packaged, not a folder); use one of {known}, or a model folder")


def _read_text(path: str, what: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{what} {path} does not exist; pass an existing UTF-8 text file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{what} {path} is not UTF-8 text ({err.reason} at byte {err.start}); convert it") from None
    if not text.strip():
        raise UsageError(f"{what} {path} is empty; pass the document the question is about")
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


def _escalate_arg(text: str | None, scope: str = "answer"):
    from kvcert.serve.generate import AUTO, Escalation

    if text is None or text.lower() == AUTO:
        return AUTO  # generate's default: study 4's answer-level certificate escalation where a calibration applies
    if text.lower() == "none":
        return None
    try:
        rate = float(text)
    except ValueError:
        raise UsageError(f"--escalate {text!r} is not a rate; pass the share of answers to re-read, e.g. 0.1") from None
    if not 0.0 < rate < 1.0:
        raise UsageError(f"--escalate {rate:g} is outside (0, 1); pass the share of answers to escalate, e.g. 0.1")
    return Escalation(rate=rate, scope=scope)


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
    from kvcert.hf import ModelLoadError
    from kvcert.serve import load_model

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


def _html_threshold(calibration, model_name: str, rate: float) -> tuple[float | None, str | None]:
    """The certificate the HTML colour scale turns red at: the calibration's threshold for escalating `rate`."""
    from kvcert.serve.calibration import Calibration, CalibrationError, shipped

    try:
        cal = shipped(model_name) if calibration == "auto" else Calibration.load(calibration) if calibration else None
        if cal is None or not cal.thresholds:
            return None, None
        return cal.threshold(rate), f"the calibration's threshold for escalating {rate:g} of answers"
    except CalibrationError:
        return None, None


def cmd_generate(args: argparse.Namespace) -> int:
    budget = _budget(args.budget)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} is below 1; pass a positive number of tokens")
    context = _read_text(args.context_file, "context file")
    if not args.question.strip():
        raise UsageError("the question is empty; pass --question with the question about the document")
    model_name = _model_name(args.model)
    calibration = _calibration_arg(args.calibration, model_name, budget)
    escalate = _escalate_arg(args.escalate, args.escalate_scope)
    tolerance, ladder = _tolerance_args(args.tolerance, args.ladder)
    if escalate is not None and not isinstance(escalate, str) and calibration is None:  # a rate given
        raise UsageError("--escalate needs a calibration (its threshold); drop --calibration none or --escalate")
    json_out, html_out = _writable(args.json, "--json"), _writable(args.html, "--html")

    import torch

    from kvcert.serve.generate import DEFAULT_ESCALATION, Escalated, Escalation, generate

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(model_name)

    def stream(event) -> None:
        if isinstance(event, Escalated):  # an answer-scope restart: what was printed is void
            print(f"\n[restarted at budget {event.budget_to:g}: {event.reason}]", flush=True)
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
        )
    except ValueError as err:  # CalibrationError, TaskError and the prompt-length check are ValueErrors
        print(flush=True)
        raise UsageError(str(err)) from None
    seconds = time.perf_counter() - started
    # the stream may show a stop string the answer then drops: the answer line is the result
    print()
    print(f"answer: {gen.text}")
    print(gen.summary())
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

        rate = escalate.rate if isinstance(escalate, Escalation) else DEFAULT_ESCALATION.rate
        threshold, label = _html_threshold(calibration, model_name, rate)
        title = f"kvcert generate: {model_name} at budget {gen.policy.budget:g}"
        write_html(gen, html_out, title=title, question=args.question, threshold=threshold, threshold_label=label)
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
    )
    cal.data["wall_s"] = round(time.perf_counter() - started)
    cal.save(out)
    print(describe(cal))
    print(f"wrote {out}")
    return 0


# ----------------------------------------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcert", description="KV-cache eviction with a calibrated certificate for every generated token."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer a question about a document from a compressed cache")
    g.add_argument("--model", required=True, help="packaged model (smollm2-135m-instruct, gemma3-270m), folder or id")
    g.add_argument("--context-file", required=True, help="the document (UTF-8 text)")
    g.add_argument("--question", required=True)
    g.add_argument("--answer-prefix", default="", help="the answer's first words (a base model needs them)")
    g.add_argument("--budget", default="0.25", help="share of the prompt the cache keeps, in (0, 1] (default 0.25)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--calibration", default=None, help="a `kvcert calibrate` file, or none (default: the shipped one)")
    g.add_argument(
        "--escalate",
        default="auto",
        help="re-read with the full cache for this share of answers, none, or auto (default: study 4's rule, the "
        "answer restarted with the full cache at the calibration's 20%% certificate threshold)",
    )
    g.add_argument(
        "--escalate-scope",
        default="answer",
        choices=["token", "answer"],
        help="token: re-read and go on from the token that crossed; answer: discard the answer and restart it",
    )
    g.add_argument(
        "--tolerance",
        default=None,
        help="choose the smallest budget of --ladder whose prefill probe error (relative attention error) is within "
        "this, e.g. 0.1 (--budget is then ignored)",
    )
    g.add_argument("--ladder", default="0.125,0.25,0.5,1", help="the budgets --tolerance chooses from")
    g.add_argument("--json", default=None, help="write the generation (tokens, certificates) as JSON here")
    g.add_argument("--html", default=None, help="write the self-contained HTML view here")
    g.add_argument("--seed", type=int, default=0, help="the randomized design's draws")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("calibrate", help="fit the certificate's calibration for a model")
    c.add_argument("--model", required=True)
    c.add_argument("--tasks", default=DEFAULT_TASKS, help=f"packaged tasks, comma-separated (default {DEFAULT_TASKS})")
    c.add_argument("--data", default=None, help="a JSON-lines file of context, question, answers (instead of --tasks)")
    c.add_argument("--lengths", default="1024", help="context lengths in tokens, comma-separated")
    c.add_argument("--n", type=int, default=20, help="examples per task and length (with --data: the first n rows)")
    c.add_argument("--budgets", default="0.25,0.5", help="budgets to fit, comma-separated")
    c.add_argument("--seed", type=int, default=5000, help="make_examples seed (5000 on: disjoint from the studies)")
    c.add_argument("--out", required=True, help="the calibration file to write")
    c.add_argument("--work-dir", default=None, help="keep (and reuse) the collected data here")
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    c.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvcert.serve.calibration import CalibrationError

    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _print_warning
        try:
            return args.func(args)
        except (UsageError, CalibrationError) as err:
            return _fail(str(err))
