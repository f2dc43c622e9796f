"""The regeneration contract: regenerated records are judged against a study's published records by declared
tolerances, not by bytes (float rounding changes with the CPU, the thread count and the library versions).

    python -m kvcert.studies.regenerate check --study all -n 10   # a sample: `make regenerate-check`, minutes
    python -m kvcert.studies.regenerate full --study all           # `make reproduce`: regenerated vs published
    python -m kvcert.studies.regenerate derive --study study3 -n 10  # measure float noise -> the tolerance file

`--study` names one study (study1, study2, study3_smollm2, study3_gemma3), `study3` (both study-3 models) or `all`.

The contract (docs/reproduction.md), per study:
- the verdict of every claim is identical;
- every claim estimate (observed value and both CI bounds) lies within its declared tolerance of the published one;
- at least 99% of the (example, variant) answers are identical.

`check` regenerates n examples (evenly spaced over the published examples sorted by id, so every task and length
is drawn), splices them into the published records in place of their published rows and evaluates every claim with
the locked analysis. `full` compares a complete regenerated publication (`make reproduce` writes it to
results/<study>/regenerated/) with the published one. Both write results/<study>/regeneration{_check}.{md,json} and
fail on a changed verdict, an estimate outside its tolerance or too few identical answers.

`derive` regenerates the same sample under several float roundings (the study's locked settings, the other thread
count, the other decode path), measures how far each replicate moves every claim estimate and how many answers
flip, and writes the tolerances (preregistration/regeneration_tolerances.json) with the numbers they come from; the
studies it derives replace their own entries only, every other study's entry stays as it was:

    tolerance = K * max( sqrt(N / n) * max_r |delta_r| ,  sqrt(N_rows * p_flip) * q )

delta_r is the claim estimate's change when replicate r's n examples replace the published ones; sqrt(N / n)
projects it to all N examples under independent per-example noise; p_flip is the upper 95% bound of the measured
rate of flipped answers (a flipped cell for C1), N_rows the rows (cells) the claim reads and q the largest change
one flip makes (measured by flipping single published answers); K = 3.

This module is the command line and `check` / `full`; the comparison is kvcert.studies.regeneration_compare, the
tolerances (`derive`) kvcert.studies.regeneration_tolerances.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from kvcert.studies import published
from kvcert.studies.regeneration_compare import (
    _published,
    answers_identical,
    claim_estimates,
    compare,
    regenerate_examples,
    sample_ids,
    splice,
    study_dir,
    write_report,
)
from kvcert.studies.regeneration_tolerances import derive, load_tolerances


# --------------------------------------------------------------------------------------------- commands
def check(study: str, n: int, *, fresh: bool = True, out_dir: Path | None = None) -> dict:
    """`make regenerate-check`: n examples regenerated, spliced into the published records, judged; the report goes
    to <out_dir>/regeneration_check.{md,json} (default results/<study>/), the scratch to <out_dir>/regeneration/."""
    out = Path(out_dir) if out_dir is not None else study_dir(study)
    scratch = out / "regeneration" / "check"
    if fresh and scratch.exists():
        shutil.rmtree(scratch)  # a check always regenerates with this checkout's code
    pub = _published(study)
    ids = sample_ids(pub["examples"], n)
    tolerances = load_tolerances()  # before any work: a missing file fails at once
    regen = regenerate_examples(study, ids, scratch)
    reference = claim_estimates(study, pub)
    spliced = claim_estimates(study, splice(pub, regen))
    answers = answers_identical(pub["examples"], regen["examples"])
    result = compare(study, reference, spliced, answers, tolerances) | {"n_examples": len(ids), "ids": ids}
    paths = write_report(result, out / "regeneration_check", title=f"Regeneration check ({len(ids)} examples)")
    print(paths["md"].read_text())
    return result


def full(study: str) -> dict:
    """`make reproduce`: the regenerated publication (results/<study>/regenerated/) judged against the published."""
    regen = published.load_published(study_dir(study) / "regenerated")
    pub = _published(study)
    reference = claim_estimates(study, pub)
    new = claim_estimates(study, regen)
    answers = answers_identical(pub["examples"], regen["examples"])
    n = int(regen["examples"]["example_id"].nunique())
    result = compare(study, reference, new, answers, load_tolerances()) | {"n_examples": n}
    paths = write_report(result, study_dir(study) / "regeneration", title="Regeneration of the published records")
    print(paths["md"].read_text())
    return result


def study_groups() -> dict[str, list[str]]:
    """The names `--study` accepts beside each study of kvcert.reproduce.STUDIES: `all` (every study, in its order)
    and `study3` (both study-3 models)."""
    from kvcert.reproduce import STUDIES

    return {"all": list(STUDIES), "study3": [s for s in STUDIES if s.startswith("study3_")]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.studies.regenerate", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["check", "full", "derive"])
    groups = study_groups()
    parser.add_argument("--study", default="all", choices=[*groups["all"], *groups])
    parser.add_argument("-n", type=int, default=10, help="examples per study (check, derive); default 10")
    parser.add_argument("--resume", action="store_true", help="check: reuse examples already regenerated")
    args = parser.parse_args(argv)
    studies = groups.get(args.study, [args.study])
    if args.n < 1:
        print("error: -n must be at least 1 (examples per study)", file=sys.stderr)
        return 2
    try:
        if args.command == "derive":
            derive(studies, args.n)
            return 0
        results = [check(s, args.n, fresh=not args.resume) if args.command == "check" else full(s) for s in studies]
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = [r["study"] for r in results if not r["ok"]]
    if failed:
        print(f"error: regeneration outside the contract for {', '.join(failed)} (tables above)", file=sys.stderr)
        return 1
    print(f"[kvcert] regeneration within the contract: {', '.join(studies)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
