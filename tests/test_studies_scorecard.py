"""The combined scorecard (kvcert.studies.scorecard) from per-study scorecards built by the locked
build_scorecard: studies object, replication labels, the inconclusive-direction footer, strict JSON."""

import json

from kvcert.analysis.claims import ClaimResult
from kvcert.analysis.scorecard import build_scorecard
from kvcert.studies.scorecard import (
    NOT_EVALUATED,
    combined_html,
    combined_markdown,
    combined_scorecard,
    replication,
    replication_preregistered,
    write_combined,
)

IDS = ["C1", "C2", "C3", "T1"]
VERIFIED = {"status": "verified", "changed": [], "missing": [], "added": []}
UNLOCKED = {"status": "unlocked"}


def _cond(metric, direction, threshold, est, status="undecided"):
    value = {"estimate": est, "lo": est - 1, "hi": est + 1}
    return {"metric": metric, "direction": direction, "threshold": threshold, "status": status, "value": value}


def _claim(cid, verdict, observed, paper, conditions=None, **kw):
    return ClaimResult(
        id=cid,
        claim=f"claim {cid}",
        verdict=verdict,
        observed=observed,
        ci=[observed - 1, observed + 1],
        paper_verdict=paper,
        conditions=conditions or [_cond("m", ">", 0.0, observed)],
        n_examples=100,
        **kw,
    )


def _t1(ratio_hi=1.05):
    return ClaimResult(
        id="T1",
        verdict="supported",
        observed=1.0,
        ci=[0.98, ratio_hi],
        paper_verdict="supported",
        unit="ratio",
        details={"ci_kind": "range over lambda of mean V_hat / MSE (not a confidence interval)"},
    )


def _cards():
    s1 = build_scorecard(
        [
            _claim("C1", "refuted", -3.0, "supported"),
            _claim("C2", "supported", 4.0, "supported"),
            # inconclusive, paper refutes, estimate on the predicted side: against the paper
            _claim("C3", "inconclusive", float("nan"), "refuted", [_cond("gain", ">=", 2.0, 3.5)]),
            _t1(),
        ],
        VERIFIED,
        ids=IDS,
    )
    s1["profile"] = "confirmatory"
    s2 = build_scorecard(
        [
            _claim("C1", "refuted", -2.0, "supported"),
            _claim("C2", "refuted", -4.0, "supported"),
            # C3: missing from study 2 (not evaluated); T1 with an infinite bound -> null
            _t1(float("inf")),
        ],
        UNLOCKED,
        ids=IDS,
    )
    return s1, s2


def test_studies_object_side_by_side_and_replication():
    s1, s2 = _cards()
    card = combined_scorecard(
        {"study1": s1, "study2": s2},
        secondary={"S1": {"estimate": 0.94, "lo": 0.93, "hi": float("nan"), "status": "undecided"}},
        power={"C1": {"target_n": 360}},
    )
    assert list(card["studies"]) == ["study1", "study2"]
    st1 = card["studies"]["study1"]
    assert st1["lock"]["line"] == "Pre-registration: locked and verified" and st1["profile"] == "confirmatory"
    assert [c["id"] for c in st1["claims"]] == IDS
    assert all(c["interval"] == c["ci"] for c in st1["claims"])
    assert card["studies"]["study2"]["secondary"]["S1"]["hi"] is None
    rows = {r["id"]: r for r in card["side_by_side"]}
    assert [r["id"] for r in card["side_by_side"]] == IDS
    assert rows["C1"]["replication"] == "replicated" and rows["C1"]["replication_studies"] == 2
    assert rows["C2"]["replication"] == "flipped"
    assert rows["C3"]["replication"] == "open" and rows["C3"]["replication_studies"] == 1  # study 2 did not evaluate
    assert [rows[c]["replication_preregistered"] for c in ("C1", "C2", "C3")] == ["replicated", "flipped", "open"]
    assert rows["C3"]["studies"]["study2"]["verdict"] == "not evaluated"
    assert rows["C1"]["studies"]["study2"]["observed"] == -2.0 and rows["C1"]["paper_verdict"] == "supported"
    assert card["footer"]["power"] == {"study2": [{"id": "C1", "n": 100, "target_n": 360, "reaches_target": False}]}
    assert "not a confidence interval" in card["footer"]["t1_interval"]["text"]
    assert "multiplicity" in card["footer"]["multiplicity"]


def test_inconclusive_direction_relative_to_the_paper():
    s1, s2 = _cards()
    toward = build_scorecard(
        [_claim("C1", "inconclusive", 0.5, "supported", [_cond("a", ">", 0.0, 0.5), _cond("b", ">=", 1.0, 1.2)])],
        UNLOCKED,
        ids=["C1"],
    )
    against = build_scorecard(
        [_claim("C1", "inconclusive", 0.5, "supported", [_cond("a", ">", 0.0, 0.5), _cond("b", ">=", 1.0, 0.2)])],
        UNLOCKED,
        ids=["C1"],
    )
    undefined = build_scorecard(
        [_claim("C1", "inconclusive", 0.5, "supported", [_cond("a", ">", 0.0, float("nan"))])], UNLOCKED, ids=["C1"]
    )
    card = combined_scorecard({"study1": s1, "study2": toward, "s3": against, "s4": undefined})
    d = card["footer"]["inconclusive_direction"]
    assert [(x["id"], x["direction"]) for x in d["study1"]] == [("C3", "against")]
    assert d["study1"][0]["conditions"][0] == {
        "metric": "gain",
        "direction": ">=",
        "threshold": 2.0,
        "estimate": 3.5,
        "side": "predicted",
    }
    assert d["study2"][0]["direction"] == "toward the paper's verdict"
    assert d["s3"][0]["direction"] == "against"
    assert d["s4"][0]["direction"] == "n/a"
    assert d["study1"][0]["paper_verdict"] == "refuted"


def test_strict_json_markdown_and_html(tmp_path):
    s1, s2 = _cards()
    card = combined_scorecard({"study1": s1, "study2": s2}, secondary={"S4": {"estimate": 0.001, "status": "met"}})
    fig = tmp_path / "figures" / "f.png"
    fig.parent.mkdir()
    fig.write_bytes(b"")
    paths = write_combined(card, tmp_path / "combined", [fig])
    text = paths["json"].read_text()
    assert text.endswith("}\n") and "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text)
    assert loaded["side_by_side"][2]["studies"]["study1"]["observed"] is None  # NaN -> null
    assert loaded["studies"]["study2"]["claims"][-1]["ci"] == [0.98, None]  # inf -> null
    md = paths["md"].read_text()
    assert "- study1: Pre-registration: locked and verified" in md
    assert "- study2: Pre-registration: NOT LOCKED" in md
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in md.splitlines() if line.startswith("|")]
    assert ["C2: claim C2", "supported 4.000 [3.000, 5.000]", "refuted -4.000 [-5.000, -3.000]"] in [
        r[:3] for r in rows
    ]
    assert "not evaluated" in md and "flipped" in md and "range [0.980, 1.050]" in md
    assert "S4" in [r[0] for r in rows]
    assert md == combined_markdown(card)
    page = paths["html"].read_text()
    assert page == combined_html(card, ["../figures/f.png"]) and 'src="../figures/f.png"' in page
    assert "NOT LOCKED" in page and "S4" in page


def test_replication_is_taken_over_the_studies_that_evaluated_the_claim():
    """A study that did not evaluate a claim is left out: the others deciding it alike replicate it (with their
    count), one supporting and one refuting flip it, a single evaluating study leaves it open; the pre-registered
    rule, which counts a not-evaluated study as open, is kept beside it."""
    ne = NOT_EVALUATED
    assert replication(["refuted", "refuted", ne, "refuted", ne]) == ("replicated", 3)
    assert replication_preregistered(["refuted", "refuted", ne, "refuted", ne]) == "open"
    assert replication(["supported", ne, "refuted"]) == ("flipped", 2)
    assert replication(["supported", "inconclusive", "refuted"]) == ("flipped", 3)
    assert replication([ne, "supported", ne]) == ("open", 1)
    assert replication(["supported", "inconclusive", ne]) == ("open", 2)
    assert replication([ne, ne]) == ("open", 0)
    assert replication(["supported", "supported"]) == ("replicated", 2)
    assert replication_preregistered(["supported", "supported"]) == "replicated"


def test_the_tables_show_both_replication_labels():
    s1, s2 = _cards()
    only = build_scorecard([_claim("C1", "refuted", -1.0, "supported")], UNLOCKED, ids=["C1"])  # C2, C3, T1: none
    card = combined_scorecard({"study1": s1, "study2": s2, "study3": only})
    rows = {r["id"]: r for r in card["side_by_side"]}
    assert (rows["C1"]["replication"], rows["C1"]["replication_studies"]) == ("replicated", 3)
    assert rows["C2"]["replication"] == "flipped" and rows["C2"]["replication_preregistered"] == "flipped"
    assert (rows["T1"]["replication"], rows["T1"]["replication_studies"]) == ("replicated", 2)
    assert rows["T1"]["replication_preregistered"] == "open"  # study 3 did not evaluate T1
    md = combined_markdown(card)
    table = _tables(md)[1]  # the per-study table, after the one-row-per-claim summary
    assert table[0][-2:] == ["replication", "pre-registered rule"]
    by_id = {r[0].split(":")[0]: r[-2:] for r in table[2:]}
    assert by_id["C1"] == ["our verdict replicated (3/3)", "replicated"]
    assert by_id["C2"] == ["flipped (2 evaluated)", "flipped"]
    assert by_id["C3"] == ["open (1 evaluated)", "open"]
    # the rule as locked counts study 3 (which did not evaluate T1) as open, and the cell says so
    assert by_id["T1"] == ["our verdict replicated (2/2)", "open (1 not evaluated)"]
    assert "counts a column that did not evaluate the claim as open" in md
    assert "over the studies that evaluated the claim" in md
    page = combined_html(card, [])
    assert "<th>pre-registered rule</th>" in page and "<td>our verdict replicated (2/2)</td>" in page


def _tables(md: str) -> list[list[list[str]]]:
    """Every pipe table of a Markdown text, each as its rows of stripped cells (header, separator, body)."""
    tables, current = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.split("|")[1:-1]])
        elif current:
            tables.append(current)
            current = []
    return tables


def test_the_scorecard_opens_with_one_row_per_claim_and_folds_the_locks_away():
    """What holds first: one row per claim with the paper's verdict and ours (how many study x model columns, which
    way, which studies and models), read in one line ("our verdict replicated", and whether that is the paper's);
    the per-study table second; the locks and deviations in a details element at the end."""
    s1, s2 = _cards()
    only = build_scorecard([_claim("C1", "refuted", -1.0, "supported")], UNLOCKED, ids=["C1"])
    card = combined_scorecard({"study1": s1, "study2": s2, "study3_gemma3": only})
    md = combined_markdown(card)
    summary, per_study = _tables(md)[:2]
    assert summary[0] == ["claim", "paper", "ours: verdicts of the study x model columns that evaluated it", "reading"]
    assert [r[0].split(":")[0] for r in summary[2:]] == [r["id"] for r in card["side_by_side"]]  # one row per claim
    c1 = summary[2]
    assert c1[2] == "refuted in 3 of 3 (studies 1, 2, 3; SmolLM2, Gemma 3)"
    assert c1[3] == "our verdict replicated (refuted); the paper's verdict (supported) does not hold here"
    assert len(per_study[0]) == 1 + 3 + 3  # claim, the three columns, paper, replication, pre-registered rule
    assert md.index("## What holds") < md.index("## Every study's verdict") < md.index("<details>")
    assert md.index("<details>") < md.index("- study1: Pre-registration")
    page = combined_html(card, [])
    assert page.index("What holds: one row per claim") < page.index("<details>") < page.index("NOT LOCKED")
    assert "<td>our verdict replicated (refuted); the paper&#x27;s verdict (supported) does not hold here</td>" in page


def test_the_combined_scorecards_title_names_studies_and_models_not_every_column_id():
    from kvcert.studies.scorecard_claims import scorecard_title

    ids = ["study1", "study2", "study3_smollm2", "study3_gemma3", "study4_smollm2", "study4_gemma3"]
    assert scorecard_title({"studies": ids}) == "Scorecard: studies 1, 2, 3, 4 (6 columns; SmolLM2, Gemma 3)"
    assert scorecard_title({"studies": ["study1"]}) == "Scorecard: study 1 (1 column; SmolLM2)"
