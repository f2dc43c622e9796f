"""The regeneration contract (kvcert.studies.regenerate, regeneration_compare, regeneration_tolerances): sample,
splice, comparison within tolerances, reports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from kvcert.studies import regenerate as R
from kvcert.studies import regeneration_compare as RC
from kvcert.studies import regeneration_tolerances as RT

ROOT = Path(__file__).resolve().parents[1]


def _examples(ids: list[str], answers: dict[str, str] | None = None) -> pd.DataFrame:
    rows = []
    for i in ids:
        for v in ("full", "topk-0.25"):
            a = (answers or {}).get(f"{i}/{v}", "42")
            rows.append({"run": "r", "example_id": i, "variant": v, "answer": a, "logprob_mean": -0.5})
            rows[-1] |= {"logprob_min": -1.0, "cert_score": 0.1, "rel_error_mean": 0.01, "kept_tokens": 100.0}
            rows[-1] |= {"covered95": 0.95}
    return pd.DataFrame(rows)


def test_sample_is_evenly_spaced_over_sorted_ids_and_covers_every_task():
    ids = [f"{t}-{k}k-s0-{i:04d}" for t in ("a", "b", "c") for k in (1, 2) for i in range(4)]
    examples = pd.DataFrame({"example_id": ids[::-1]})  # order in the file does not matter
    picked = RC.sample_ids(examples, 6)
    assert picked == sorted(picked) and len(picked) == 6
    assert picked[0] == "a-1k-s0-0000" and picked[-1] == "c-2k-s0-0003"
    assert {p.split("-")[0] for p in picked} == {"a", "b", "c"}
    assert RC.sample_ids(examples, 100) == sorted(ids)
    assert RC.sample_ids(examples, 6) == picked  # deterministic


def test_splice_replaces_exactly_the_regenerated_examples():
    pub = {"examples": _examples(["e0", "e1", "e2"])}
    pub["cells"] = pd.DataFrame({"example_id": pd.Categorical(["e0", "e1"]), "n_cells": [3, 4], "run": "r"})
    pub["exceedances"] = pd.DataFrame({"example_id": ["e0", "e1"], "error": [1.0, 2.0]})
    regen = {"examples": _examples(["e1"], {"e1/full": "7"})}
    regen["cells"] = pd.DataFrame({"example_id": ["e1"], "n_cells": [5], "run": "r"})
    regen["exceedances"] = pd.DataFrame({"example_id": ["e1"], "error": [9.0]})
    out = RC.splice(pub, regen)
    ex = out["examples"]
    assert len(ex) == 6 and ex.loc[(ex.example_id == "e1") & (ex.variant == "full"), "answer"].tolist() == ["7"]
    assert sorted(out["cells"]["n_cells"]) == [3, 5]
    assert isinstance(out["cells"]["example_id"].dtype, pd.CategoricalDtype)
    assert sorted(out["exceedances"]["error"]) == [1.0, 9.0]


def test_answers_identical_counts_rows_and_refuses_unknown_rows():
    pub = _examples(["e0", "e1"])
    regen = _examples(["e0", "e1"], {"e1/topk-0.25": "41"})
    regen.loc[0, "logprob_mean"] = -0.5 + 3e-6
    res = RC.answers_identical(pub, regen)
    assert (res["rows"], res["identical"]) == (4, 3) and res["share"] == 0.75
    assert res["max_abs_change_where_identical"]["logprob_mean"] == pytest.approx(3e-6)
    with pytest.raises(ValueError, match="no published row"):
        RC.answers_identical(pub, _examples(["e9"]))


def test_cells_flipped_is_half_the_count_distance():
    keys = {"run": "r", "variant": "v", "layer": 0, "tail_bin": 0, "pmax_bin": 0, "trusted": False}
    a = pd.DataFrame([{**keys, "example_id": "e0", "ratio_bin": b, "n_cells": n} for b, n in ((0, 10), (1, 5))])
    b = pd.DataFrame([{**keys, "example_id": "e0", "ratio_bin": b, "n_cells": n} for b, n in ((0, 9), (1, 6))])
    assert RC.cells_flipped(a, b) == {"cells": 15, "flipped": 1}


def _card(verdict="supported", observed=1.0):
    return {"C2": {"verdict": verdict, "observed": observed, "ci_lo": observed - 1, "ci_hi": observed + 1}}


TOL = {"studies": {"s": {"claims": {"C2": {"tolerance": 0.5}}}}}
ANSWERS = {"rows": 100, "identical": 100, "share": 1.0}


def test_compare_passes_within_tolerance_and_fails_outside_it():
    ok = RC.compare("s", _card(), _card(observed=1.4), ANSWERS, TOL)
    assert ok["ok"] and all(r["pass"] for r in ok["claims"])
    bad = RC.compare("s", _card(), _card(observed=1.6), ANSWERS, TOL)
    assert not bad["ok"]
    assert [r["estimate"] for r in bad["claims"] if not r["pass"]] == ["observed", "ci_lo", "ci_hi"]


def test_compare_fails_on_a_changed_verdict_or_too_few_identical_answers():
    assert not RC.compare("s", _card(), _card("inconclusive"), ANSWERS, TOL)["ok"]
    few = RC.compare("s", _card(), _card(), {"rows": 100, "identical": 98, "share": 0.98}, TOL)
    assert not few["ok"] and not few["answers"]["pass"]
    assert RC.compare("s", _card(), _card(), {"rows": 100, "identical": 99, "share": 0.99}, TOL)["ok"]


def test_report_is_rounded_and_readable(tmp_path):
    res = RC.compare("s", _card(observed=1 / 3), _card(observed=1 / 3 + 1e-13), ANSWERS, TOL) | {"n_examples": 2}
    paths = RC.write_report(res, tmp_path / "regeneration_check", title="Regeneration check")
    data = json.loads(paths["json"].read_text())
    assert data["claims"][1]["published"] == 0.3333333333 and data["ok"] is True
    text = paths["md"].read_text()
    assert "Result: **PASS**" in text and re.search(r"^\| C2 +\| observed +\|", text, re.M) and "100 of 100" in text


def test_missing_tolerances_say_how_to_derive_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="regenerate derive"):
        RT.load_tolerances(tmp_path / "none.json")


def test_declared_tolerances_cover_every_record_claim_of_every_study():
    import yaml

    from kvcert.reproduce import settings

    tol = RT.load_tolerances()
    studies = R.study_groups()["all"]
    assert set(tol["studies"]) == set(studies)
    for study in studies:
        claims = yaml.safe_load(Path(settings(study)["predictions"]).read_text())["claims"]
        record_claims = {c for c, spec in claims.items() if spec.get("analysis") != "t1"}
        declared = tol["studies"][study]["claims"]
        assert record_claims == set(declared), study
        for cid, entry in declared.items():  # the tolerance follows from the measurements it records
            expected = tol["multiple"] * max(entry["projected_sqrt_N_over_n"], entry["flip_floor"])
            assert entry["tolerance"] == pytest.approx(expected, rel=1e-8), (study, cid)


def test_study_names_on_the_command_line():
    from kvcert.reproduce import STUDIES

    groups = R.study_groups()
    assert groups["all"] == list(STUDIES) == ["study1", "study2", "study3_smollm2", "study3_gemma3"]  # `all`: every one
    assert groups["study3"] == ["study3_smollm2", "study3_gemma3"]
    with pytest.raises(SystemExit):  # argparse names the choices
        R.main(["check", "--study", "study4"])


def test_derive_replaces_only_the_studies_it_derived(tmp_path):
    """Deriving study 3 leaves studies 1 and 2's tolerances byte for byte; a study derived again is replaced."""
    path = tmp_path / "tolerances.json"
    path.write_text((ROOT / "preregistration" / "regeneration_tolerances.json").read_text())
    before = json.loads(path.read_text())
    RT.write_tolerances({"study3_smollm2": {"cpu": "x", "claims": {"C2": {"tolerance": 1.0 / 3}}}}, path)
    after = json.loads(path.read_text())
    for study in ("study1", "study2", "study3_gemma3"):
        assert json.dumps(after["studies"][study]) == json.dumps(before["studies"][study])
    assert after["studies"]["study3_smollm2"] == {"cpu": "x", "claims": {"C2": {"tolerance": 0.3333333333}}}
    assert after["cpu"] == before["cpu"] and after["multiple"] == RT.MULTIPLE
    RT.write_tolerances({}, tmp_path / "new.json")  # no file yet: a document with no study
    assert json.loads((tmp_path / "new.json").read_text())["studies"] == {}


@pytest.mark.slow
def test_check_regenerates_one_example_within_the_contract(tmp_path):
    """One study-1 example regenerated by this checkout on the packaged model, judged by the declared contract."""
    res = R.check("study1", 1, out_dir=tmp_path)
    assert res["ok"], (tmp_path / "regeneration_check.md").read_text()
    assert res["answers"]["rows"] == 21 and res["n_examples"] == 1
    assert (tmp_path / "regeneration_check.md").read_text().count("| C") == 7 * 4


def test_full_judges_a_study3_model_against_its_published_records(tmp_path, monkeypatch):
    """`make reproduce`'s last step on study 3: a regenerated publication equal to the published one passes, and the
    report names the study, every record claim and its answers (Gemma 3: the smaller of the two models)."""
    import shutil

    from kvcert.reproduce import settings

    shutil.copytree(settings("study3_gemma3")["published"], tmp_path / "regenerated")
    monkeypatch.setattr(R, "study_dir", lambda study: tmp_path)
    res = R.full("study3_gemma3")
    assert res["ok"] and res["n_examples"] == 126
    assert res["answers"]["rows"] == res["answers"]["identical"] == 126 * 22
    text = (tmp_path / "regeneration.md").read_text()
    assert "Study: study3_gemma3. Result: **PASS**" in text
    assert {r["claim"] for r in res["claims"]} == {"C1", "C2", "C3", "C4", "C6", "C7"}
    assert all(r["difference"] in (None, 0.0) for r in res["claims"])
