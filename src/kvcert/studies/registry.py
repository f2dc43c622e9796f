"""The studies' registry: each study's predictions, claim configs, output folders, lock and pinned threads (STUDIES),
the run profiles (PROFILES) and `settings`, a study's entry with a profile applied. Below kvcert.reproduce and
kvcert.studies.analyze, which both read it (kvcert.reproduce re-exports these names); see kvcert.reproduce for
what each study is."""

from __future__ import annotations

from pathlib import Path

from kvcert.run import ROOT, config_dir

CONF = config_dir()  # the checkout's conf/, or the copy in the installed wheel
PREDICTIONS = ROOT / "preregistration" / "predictions.yaml"
PROFILES = {
    # both studies decode through the one engine; their records are regenerated within the declared tolerances
    # (kvcert.studies.regenerate), the bit-exact code is at the tags study1-records / study2-records
    "confirmatory": {"out": ROOT / "results", "overrides": []},
    # tiny data, same grid: exercises every design and every analysis, verdicts mostly inconclusive
    "smoke": {
        "out": ROOT / "results" / "smoke",
        "overrides": [
            "task.n_examples=1",
            "task.context_tokens=[400]",
            "decode.max_new_tokens=10",
            "results_dir=results/smoke/runs",
        ],
        "t1_draws": 400,
    },
}

STUDIES: dict[str, dict] = {
    "study1": {
        "predictions": PREDICTIONS,
        "claims": CONF / "claim",  # top-level *.yaml only (registry's glob): conf/claim/study2/ is not study 1's
        "prefix": "",  # the claim group option is <prefix><file stem>
        "out": ROOT / "results",
        "overrides": PROFILES["confirmatory"]["overrides"],
        "threads": 1,  # its published records are the 1-thread regeneration (DEVIATIONS.md, 2026-12-03)
        "lock": "study1",  # kvcert.prereg.STUDIES
        "scorecard": ROOT / "results" / "study1",  # its own scorecard; results/scorecard.* shows both studies
        "published": ROOT / "results" / "study1" / "published",
        "multipliers": None,
    },
    "study2": {
        "predictions": ROOT / "preregistration" / "study2" / "predictions.yaml",
        "claims": CONF / "claim" / "study2",
        "prefix": "study2/",
        "out": ROOT / "results" / "study2",
        "overrides": [],
        "threads": 2,  # pinned by conf/claim/study2/*.yaml (PLAN.md D4)
        "lock": "study2",
        "scorecard": ROOT / "results" / "study2",
        "published": ROOT / "results" / "study2" / "published",
        "multipliers": ROOT / "preregistration" / "study2" / "conformal_by_layer.csv",  # S2 (PLAN.md section 5)
    },
}
# Study 3 (preregistration/study3/PLAN.md): two models under one plan and one lock, each a study entry of its own
# (its predictions file, claim configs, records and scorecard), run one thread each so the two can run side by side.
STUDY3_C1_AND_S6C_ROWS = {  # published cells: C1's rows and S6c's (the same scorer at tail fraction 0.25)
    "design": "randomized",
    "scorer": "window_question",
    "budget": [0.25, 0.5],
    "tail_fraction": [0.75, 0.25],
    "floor": 0.2,
    "score_power": 1.0,
}
for _model, _multipliers in (
    ("smollm2", ROOT / "preregistration" / "study2" / "conformal_by_layer.csv"),  # carried over (PLAN.md 4)
    ("gemma3", ROOT / "preregistration" / "study3" / "conformal_by_layer_gemma3-270m.csv"),  # its pilot's fit
):
    STUDIES[f"study3_{_model}"] = {
        "predictions": ROOT / "preregistration" / "study3" / f"predictions_{_model}.yaml",
        "claims": CONF / "claim" / "study3" / _model,
        "prefix": f"study3/{_model}/",
        "out": ROOT / "results" / "study3" / _model,
        "overrides": [],
        "threads": 1,  # pinned by conf/claim/study3/<model>/*.yaml
        "lock": "study3",
        "scorecard": ROOT / "results" / "study3" / _model,
        "published": ROOT / "results" / "study3" / _model / "published",
        "multipliers": _multipliers,
        "publish_rows": STUDY3_C1_AND_S6C_ROWS,
    }


def settings(study: str = "study1", profile: str = "confirmatory") -> dict:
    """The study's entry with the profile applied: predictions, claims (conf dir), prefix, out, overrides (ending
    with threads=N), threads, lock, t1_draws. Study 1 under a profile is exactly that profile, as before."""
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}; choose one of {sorted(STUDIES)}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    st = dict(STUDIES[study])
    st["out"] = Path(st["out"])
    if profile != "confirmatory":
        prof = PROFILES[profile]
        if study == "study1":
            st["out"], overrides = Path(prof["out"]), list(prof["overrides"])
        else:  # the study's own path and decode switches, the profile's tiny data, under <out>/<profile>
            st["out"] = st["out"] / profile
            tiny = [o for o in prof["overrides"] if not o.startswith("results_dir=")]
            overrides = [*st["overrides"], *tiny, f"results_dir={st['out'] / 'runs'}"]
        st["overrides"] = overrides
        st["t1_draws"] = prof.get("t1_draws")
        st["published"] = st["out"] / "published"
        st["scorecard"] = st["out"] / "study1" if study == "study1" else st["out"]
    st["overrides"] = [*st["overrides"], f"threads={int(st['threads'])}"]
    st.setdefault("t1_draws", None)
    return st
