"""Study 4 (preregistration/study4/PLAN.md): an actionable certificate, decided by a locked study.

    python -m kvcert.studies.study4 <command> ...   # select, run, analyze, token-reference, regenerate-check,
                                                    # derive, thresholds (kvcert.studies.study4.cli; --help)

Modules, each importing only those listed before it:

- common: the models, the design's grid, the folders, the planned examples and whether records are complete;
- collect: the records (one row per example and budget, from kvcert.generate's serving path);
- analysis: escalation policies at matched rates and discrimination, pure pandas over the records;
- claims: the claims and verdicts by the decision rules of the predictions files;
- regeneration: regenerated records against the published ones, and the tolerances that judge them;
- cli: the level selection, the runs, the analysis, the shipped thresholds and the command line.

The names below are re-exported so that `from kvcert.studies.study4 import scorecard_cards` (the combined scorecard)
and the like keep working.
"""

from kvcert.studies.study4.cli import (
    REFERENCE_BUDGET,
    REFERENCE_RATE,
    THRESHOLD_RATES,
    analyze,
    budget_thresholds,
    choose_level,
    main,
    run,
    scorecard_cards,
    select,
    ship_thresholds,
    token_reference,
)
from kvcert.studies.study4.common import (
    BUDGETS,
    LENGTHS,
    MODELS,
    N_PER_MODEL,
    NEW_TEMPLATES,
    PREREG,
    REGENERATED,
    RESULTS,
    SEED,
    STUDY3_TASKS,
    complete,
    examples_for,
    planned_examples,
)

__all__ = [
    "BUDGETS",
    "LENGTHS",
    "MODELS",
    "N_PER_MODEL",
    "NEW_TEMPLATES",
    "PREREG",
    "REFERENCE_BUDGET",
    "REFERENCE_RATE",
    "REGENERATED",
    "RESULTS",
    "SEED",
    "STUDY3_TASKS",
    "THRESHOLD_RATES",
    "analyze",
    "budget_thresholds",
    "choose_level",
    "complete",
    "examples_for",
    "main",
    "planned_examples",
    "run",
    "scorecard_cards",
    "select",
    "ship_thresholds",
    "token_reference",
]
