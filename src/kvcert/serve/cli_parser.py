"""The `kvcert` command's arguments (`kvcert.serve.cli` runs them): every option with its help and default."""

from __future__ import annotations

import argparse

DEFAULT_TASKS = "single_needle,multikey_needle,fact_qa"
ESCALATE_CHOICES = "none, study4 or a rate in (0, 1) such as 0.1"


def _generate_parser(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="answer a question about a document from a compressed cache",
        description="Answer a question about a document from a compressed KV cache, with a calibrated certificate "
        "for every token. Nothing is escalated unless --escalate asks (default none).",
    )
    g.add_argument(
        "--model",
        required=True,
        help="a packaged model (smollm2-135m-instruct or smollm2, gemma3-270m or gemma3, qwen2.5-coder-0.5b-instruct "
        "or qwen2.5), a local model folder, or a Hugging Face hub id (downloaded beforehand: hf download <id>)",
    )
    g.add_argument("--context-file", required=True, help="the document the question is about (UTF-8 text)")
    g.add_argument("--question", required=True, help="the question to answer from the document")
    g.add_argument(
        "--answer-prefix",
        default=None,
        help="the answer's first words, read with the prompt and not printed (default: 'Answer:' for a model "
        "without a chat template, such as gemma3, none for a chat model; '' for none)",
    )
    g.add_argument(
        "--budget", default="0.25", help="share of the prompt the cache keeps, in (0, 1] (default %(default)s)"
    )
    g.add_argument("--budget-file", default=None, help="use the budget a `kvcert calibrate-budget` file chose "
                   "(and state its guarantee; --budget is then ignored)")  # fmt: skip
    g.add_argument("--group", default=None, help="with --budget-file: the prompt's group (default: the pooled budget)")
    g.add_argument(
        "--max-new-tokens", type=int, default=64, help="the most tokens the answer may have (default %(default)s)"
    )
    g.add_argument("--calibration", default=None, help="a `kvcert calibrate` file, or none (default: the shipped one)")
    g.add_argument(
        "--escalate",
        default="none",
        metavar="{none,study4,RATE}",
        help="none: never (study 5 found no per-answer trigger that beats confidence inside one kind of prompt); "
        "study4: study 4's rule, the answer restarted with the full cache when its largest certificate crosses the "
        "calibration's threshold for a 20%% escalation rate at the budget; a rate in (0, 1) such as 0.1: that share "
        "of answers, by the calibration's threshold for it (default %(default)s)",
    )
    g.add_argument(
        "--escalate-scope",
        default="answer",
        choices=["token", "answer"],
        help="answer: discard the answer and restart it with the full cache; token: re-read and go on from the token "
        "that crossed (default %(default)s)",
    )
    g.add_argument(
        "--escalate-signal",
        default="certificate",
        choices=["certificate", "agreement"],
        help="what --escalate RATE reads: certificate (the answer's largest certificate) or agreement (the draws' "
        "disagreement about the answer; needs --draws and a calibration fitted with the same draws) "
        "(default %(default)s)",
    )
    _draws_arguments(g, "decode N draws of the policy as rows of one batch from one read; the answer is draw 0's "
                     "and the others report how far they agree with it (default: one draw)")  # fmt: skip
    g.add_argument(
        "--tolerance",
        default=None,
        help="choose the smallest budget of --ladder whose prefill probe error (relative attention error) is within "
        "this, e.g. 0.1 (--budget is then ignored; default: off)",
    )
    g.add_argument(
        "--ladder", default="0.125,0.25,0.5,1", help="the budgets --tolerance chooses from (default %(default)s)"
    )
    g.add_argument("--json", default=None, help="write the generation (tokens, certificates) as JSON here")
    g.add_argument("--html", default=None, help="write the self-contained HTML view here")
    g.add_argument("--seed", type=int, default=0, help="seed of the randomized design's draws (default %(default)s)")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def _draws_arguments(parser, what: str) -> None:
    parser.add_argument("--draws", default=None, metavar="N", help=f"{what}; N >= 2")
    parser.add_argument(
        "--draws-variant",
        default=None,
        choices=["independent", "split"],
        help="independent: N draws of the policy; split: one draw's tail split in two halves (2 rows, no more KV "
        "than one draw; --draws may be left out) (default: independent)",
    )


def _calibrate_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="fit the certificate's calibration for a model")
    c.add_argument("--model", required=True, help="a packaged model, a local model folder or a hub id")
    c.add_argument("--tasks", default=DEFAULT_TASKS, help="packaged tasks, comma-separated (default %(default)s)")
    c.add_argument("--data", default=None, help="a JSON-lines file of context, question, answers (instead of --tasks)")
    c.add_argument("--lengths", default="1024", help="context lengths in tokens, comma-separated (default %(default)s)")
    c.add_argument(
        "--n",
        type=int,
        default=20,
        help="examples per task and length (with --data: the first n rows; default %(default)s)",
    )
    c.add_argument("--budgets", default="0.25,0.5", help="budgets to fit, comma-separated (default %(default)s)")
    c.add_argument(
        "--seed",
        type=int,
        default=5000,
        help="make_examples seed (5000 on: disjoint from the studies; default %(default)s)",
    )
    _draws_arguments(c, "also fit the agreement signal's thresholds per budget, from N draws of the policy "
                     "decoded with each (default: no draws, no agreement thresholds)")  # fmt: skip
    c.add_argument("--out", required=True, help="the calibration file to write")
    c.add_argument("--work-dir", default=None, help="keep (and reuse) the collected data here")
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def build_parser() -> argparse.ArgumentParser:
    """The parser; the chosen subcommand is `args.command` ("generate", "calibrate", "calibrate-budget" or "report")."""
    parser = argparse.ArgumentParser(
        prog="kvcert", description="KV-cache eviction with a calibrated certificate for every generated token."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _calibrate_parser(sub)
    from kvcert.report import add_parser as report_parser
    from kvcert.serve.budget_cli import add_parser as budget_parser

    budget_parser(sub)  # calibrate-budget
    report_parser(sub)  # kvcert report <runs or multirun folder>
    return parser
