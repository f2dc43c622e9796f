"""`kvcert calibrate-budget` (its arguments and the command) and `kvcert generate --budget-file F [--group G]`.

    kvcert calibrate-budget --model smollm2 --data my.jsonl [--group-field kind] [--alpha 0.1] [--delta 0.1] \
        [--method ltt|crc] [--loss differs|accuracy] [--ladder 0.1,0.25,0.5,0.75] --out calibrated.json
    kvcert generate --model smollm2 --context-file doc.txt --question "..." --budget-file calibrated.json [--group qa]

Bad input is a `BudgetError` (a CalibrationError: `kvcert.serve.cli.main` prints it as one `error:` line, exit 2).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvcert.serve.budget_file import BudgetError


def add_parser(sub) -> None:
    c = sub.add_parser(
        "calibrate-budget",
        help="choose the smallest KV budget whose risk of changing the answer is at most alpha, with a guarantee",
        description="Decode the full cache and a ladder of budgets from one read of each of your prompts and choose "
        "the smallest budget whose risk (the answer differs from the full cache's, or accuracy lost) is at most "
        "alpha: with probability >= 1 - delta (Learn-then-Test, the default) or in expectation (conformal risk "
        "control); pooled, and per group with --group-field (per task x length for --tasks). Writes one file that "
        "`kvcert generate --budget-file` uses.",
    )
    c.add_argument("--model", required=True, help="a packaged model, a local model folder or a hub id")
    c.add_argument("--data", default=None, help="a JSON-lines file of context, question[, answers] (as task=jsonl)")
    c.add_argument("--group-field", default=None, help="the JSONL field naming each prompt's kind (default: none)")
    c.add_argument("--tasks", default=None, help="packaged tasks, comma-separated, instead of --data")
    c.add_argument("--lengths", default="1024", help="with --tasks: context lengths in tokens (default %(default)s)")
    c.add_argument("--n", type=int, default=None, help="with --tasks: prompts per task and length (default 20); "
                   "with --data: the first n rows (default: all)")  # fmt: skip
    c.add_argument("--seed", type=int, default=5000, help="with --tasks: make_examples seed (default %(default)s)")
    c.add_argument("--alpha", type=float, default=0.1, help="the risk level (default %(default)s)")
    c.add_argument("--delta", type=float, default=0.1, help="ltt: the guarantee fails with probability at most "
                   "this (default %(default)s)")  # fmt: skip
    c.add_argument("--method", default="ltt", choices=["ltt", "crc"], help="ltt: P(risk <= alpha) >= 1 - delta; "
                   "crc: E[risk] <= alpha (default %(default)s)")  # fmt: skip
    c.add_argument("--loss", default="differs", choices=["differs", "accuracy"], help="differs: the answer differs "
                   "from the full cache's (no labels); accuracy: the score lost against the full cache by --metric "
                   "(needs answers) (default %(default)s)")  # fmt: skip
    c.add_argument("--metric", default="f1", help="with --data and --loss accuracy: exact, contains, f1 or "
                   "pkg.mod:func (default %(default)s)")  # fmt: skip
    c.add_argument("--ladder", default="0.1,0.25,0.5,0.75", help="budgets below the full cache (default %(default)s)")
    c.add_argument("--max-new-tokens", type=int, default=32, help="answer length decoded (default %(default)s)")
    c.add_argument("--out", required=True, help="the budget file to write")
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def _ladder(text: str) -> list[float]:
    try:
        rungs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BudgetError(f"--ladder {text!r} is not a list of budgets; pass e.g. 0.1,0.25,0.5,0.75") from None
    if not rungs or any(not 0.0 < b < 1.0 for b in rungs):
        raise BudgetError(f"--ladder {text}: every budget must lie in (0, 1) (the full cache is added), e.g. 0.1,0.5")
    return rungs


def cmd_calibrate_budget(args: argparse.Namespace) -> int:
    from kvcert.core.risk_control import refusal
    from kvcert.tasks import ALL_TASKS

    ladder = _ladder(args.ladder)
    if (args.data is None) == (args.tasks is None):
        raise BudgetError("pass --data my.jsonl or --tasks single_needle,fact_qa (one of them)")
    if args.data is not None and not Path(args.data).expanduser().is_file():
        raise BudgetError(f"data file {args.data} does not exist; pass a JSON-lines file (one prompt a line)")
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if args.tasks is not None and (unknown or not tasks):
        raise BudgetError(f"unknown task(s) {', '.join(unknown) or '(none)'}; use some of {', '.join(ALL_TASKS)}")
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise BudgetError(f"--lengths {args.lengths!r} is not a list of integers; pass e.g. 512,1024") from None
    for name in ("alpha", "delta"):
        if not 0.0 < getattr(args, name) < 1.0:
            raise BudgetError(f"--{name} {getattr(args, name):g} is outside (0, 1); pass e.g. 0.1")
    if tasks:  # the prompts' count is known before the model loads: refuse at once
        why = refusal(args.method, (args.n or 20) * len(tasks) * len(lengths), args.alpha, args.delta)
        if why is not None:
            raise BudgetError(why)
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise BudgetError(f"--out {args.out} is a folder; pass a file name")

    import torch

    from kvcert.hf.loading import ALIASES, ModelLoadError
    from kvcert.serve import load_model  # looked up here, so that tests can stand in for it
    from kvcert.serve.budget_calibration import calibrate_budget, describe

    if args.threads:
        torch.set_num_threads(args.threads)
    name = ALIASES.get(args.model, args.model)
    try:
        model, tokenizer = load_model(name)
    except ModelLoadError as err:
        raise BudgetError(str(err)) from None
    started = time.perf_counter()
    result = calibrate_budget(model, tokenizer, args.data, tasks=tasks or None, lengths=lengths, n=args.n,
                              seed=args.seed, group_field=args.group_field, metric=args.metric, ladder=ladder,
                              alpha=args.alpha, delta=args.delta, method=args.method, loss=args.loss,
                              max_new_tokens=args.max_new_tokens, model_name=name)  # fmt: skip
    result.data["command_wall_s"] = round(time.perf_counter() - started, 1)
    result.save(out)
    print(describe(result))
    print(f"wrote {out}")
    return 0


def budget_file_arg(path: str | None, group: str | None, tolerance: str | None = None):
    """--budget-file / --group -> a CalibratedBudget (None without a file; --group alone is refused, and so is a
    file with --tolerance, which chooses its own budget)."""
    from kvcert.serve.budget_file import calibrated_budget

    if path is None:
        if group is not None:
            raise BudgetError("--group picks a group of a budget file; pass --budget-file calibrated.json")
        return None
    if tolerance is not None and tolerance.lower() != "none":
        raise BudgetError("--tolerance chooses its own budget; pass --budget-file or --tolerance, not both")
    return calibrated_budget(path, group)
