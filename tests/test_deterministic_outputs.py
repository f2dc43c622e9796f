"""`make analyze` writes the same bytes on any CPU: every float in the JSON, CSV, Markdown and HTML outputs is rounded
to 10 significant digits (kvcert.analysis.scorecard.round_float) and the PNGs carry no version metadata. A different
CPU changes the last bits of sums (summation order); here every measured float of the published records moves by one
ulp and the whole `analyze --study all` (every study and the combined scorecard, on a subset of each study's
examples) must write byte-identical files."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import kvcert.reproduce as rep
from kvcert.analysis.pilot import write_pilot_summary
from kvcert.analysis.scorecard import _fmt, jsonable, round_float, round_frame
from kvcert.studies import analyze as study_analysis
from kvcert.studies import published

N_EXAMPLES = 24  # per study, spread over tasks and context lengths
N_BOOT = 200  # the rounding does not depend on the number of resamples
# the design settings are identifiers that the analysis matches exactly (predictions.yaml rows), not measurements
CONFIG_COLUMNS = {"budget", "tail_fraction", "floor", "score_power"}
WRITTEN = (".json", ".csv", ".md", ".html", ".png")


def _up(x: np.ndarray) -> np.ndarray:
    """x moved up by one float64 ulp; an exact zero stays zero (its ulp, 5e-324, is an absolute move that no
    significant-digit rounding absorbs, and a summation-order difference is relative)."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(x != 0, np.nextafter(x, np.inf), x)


def _one_ulp(df: pd.DataFrame) -> pd.DataFrame:
    """Every measured float column moved up by one float64 ulp (float32 columns widened first, in both runs)."""
    out = df.copy()
    for col in out.columns:
        if pd.api.types.is_float_dtype(out[col].dtype) and col not in CONFIG_COLUMNS:
            out[col] = _up(out[col].to_numpy(np.float64))
    return out


def _widened(df: pd.DataFrame) -> pd.DataFrame:
    """float32 columns as float64 (exact), so that both runs read the same dtypes."""
    return df.astype({c: np.float64 for c in df.columns if df[c].dtype == np.float32})


def _t1_one_ulp(t1: dict) -> dict:
    return {
        k: [float(_up(x)) if isinstance(x, float) else x for x in v] if isinstance(v, list) else v
        for k, v in t1.items()
    }


def _tree(root: Path, move: bool) -> dict[str, dict]:
    """A results tree under root laid out as results/ (study 1's out is the root, its scorecard in study1/; study 2
    in study2/), with a subset of each study's published records; returns the STUDIES entries pointing at it."""
    studies = {}
    for sid, entry in rep.STUDIES.items():
        if not Path(entry["published"]).exists():  # study 3 before its records are published
            continue
        pub = published.load_published(entry["published"])
        ids = sorted(pub["examples"]["example_id"].astype(str).unique())
        keep = set(ids[:: max(1, len(ids) // N_EXAMPLES)][:N_EXAMPLES])

        def subset(df: pd.DataFrame, keep: set = keep) -> pd.DataFrame:
            return df[df["example_id"].astype(str).isin(keep)].reset_index(drop=True)

        examples, exceed = subset(pub["examples"]), _widened(subset(pub["exceedances"]))
        t1_path = Path(entry["out"]) / "tables" / "t1.json"
        t1 = json.loads(t1_path.read_text()) if t1_path.exists() else None  # study 3 repeats no T1
        if move:
            examples, exceed = _one_ulp(examples), _one_ulp(exceed)
            t1 = _t1_one_ulp(t1) if t1 is not None else None
        out = root if sid == "study1" else root / sid
        meta = {**pub["meta"], "run": f"runs/{sid}"}
        published.write_published(
            root / "published" / sid, examples=examples, cells=subset(pub["cells"]), exceed=exceed, meta=meta
        )
        (out / "tables").mkdir(parents=True, exist_ok=True)
        if t1 is not None:
            (out / "tables" / "t1.json").write_text(json.dumps(t1))
        scorecard = root / "study1" if sid == "study1" else out
        studies[sid] = {**entry, "out": out, "published": root / "published" / sid, "scorecard": scorecard}
    return studies


def _fewer_resamples(registry: Callable[..., dict]) -> Callable[..., dict]:
    """kvcert.studies.analyze's registry with at most N_BOOT bootstrap resamples per claim (keeps the test short)."""

    def wrapped(*args: object, **kwargs: object) -> dict:
        return {
            cid: dataclasses.replace(e, spec={**e.spec, "n_boot": min(int(e.spec.get("n_boot", 2000)), N_BOOT)})
            for cid, e in registry(*args, **kwargs).items()
        }

    return wrapped


def _analyze(root: Path, move: bool) -> dict[str, bytes]:
    """`analyze --study all` on the tree; every file it wrote -> its bytes."""
    studies = _tree(root, move)
    inputs = {p for p in root.rglob("*") if p.is_file()}
    with pytest.MonkeyPatch.context() as m:
        for sid, entry in studies.items():
            m.setitem(rep.STUDIES, sid, entry)
        m.setattr(study_analysis, "registry", _fewer_resamples(study_analysis.registry))
        assert rep.main(["analyze", "--study", "all"]) == 0
    written = sorted(p for p in root.rglob("*") if p.is_file() and p not in inputs)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in written}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, bytes], dict[str, bytes]]:
    return _analyze(tmp_path_factory.mktemp("plain"), False), _analyze(tmp_path_factory.mktemp("moved"), True)


def test_analysis_outputs_do_not_move_with_the_last_bit_of_the_inputs(outputs):
    plain, moved = outputs
    assert sorted(plain) == sorted(moved)
    # study 3's model-dependence table lands in the same tree as its studies, never in the checkout's results/
    written = ("scorecard.json", "study1/scorecard.md", "study2/scorecard.html", "study2/tables/secondary.json")
    for name in (*written, "model_dependence.csv"):
        assert name in plain
    assert any(n.endswith(".csv") for n in plain) and any(n.endswith(".png") for n in plain)
    assert all(n.endswith(WRITTEN) for n in plain), sorted(n for n in plain if not n.endswith(WRITTEN))
    differ = [n for n in plain if plain[n] != moved[n]]
    assert not differ, f"outputs that depend on the last bit of the inputs: {differ}"


def test_written_floats_carry_ten_significant_digits(outputs):
    plain, _ = outputs

    def floats(obj: object) -> list[float]:
        if isinstance(obj, dict):
            return [x for v in obj.values() for x in floats(v)]
        if isinstance(obj, list):
            return [x for v in obj for x in floats(v)]
        return [obj] if isinstance(obj, float) else []

    for name, data in plain.items():
        if name.endswith(".json"):  # claim_*.json, secondary.json, the scorecards (t1.json is an input)
            assert all(round_float(x) == x for x in floats(json.loads(data))), name
        if name.endswith(".csv"):
            frame = pd.read_csv(io.BytesIO(data))
            for col in frame.select_dtypes("float"):
                assert all(round_float(x) == x for x in frame[col] if math.isfinite(x)), (name, col)
    pngs = [data for name, data in plain.items() if name.endswith(".png")]
    assert pngs and not any(b"Software" in data or b"matplotlib" in data for data in pngs)  # no version metadata


# --- the rounding helpers ----------------------------------------------------------------------------------------
def test_jsonable_rounds_floats_to_ten_significant_digits():
    assert jsonable(24.361111111111107) == jsonable(24.36111111111111) == 24.36111111
    assert jsonable({"a": [np.float64(24.361111111111107), np.float32(0.5)]}) == {"a": [24.36111111, 0.5]}
    assert jsonable([float("nan"), float("inf"), np.float64(-np.inf), 3, True]) == [None, None, None, 3, True]
    assert jsonable(1e-300) == 1e-300 and jsonable(123456789012.0) == 123456789000.0


def test_markdown_numbers_come_from_the_rounded_value():
    # 0.1235 is stored just below it ("0.123"); its upper neighbour would print "0.124" unrounded
    assert f"{0.12350000000000001:.3f}" == "0.124" and _fmt(0.12350000000000001) == _fmt(0.1235) == "0.123"
    assert _fmt(-1e-17) == _fmt(1e-17) == "0.000"  # a zero up to summation noise: never "-0.000"
    assert _fmt(24.361111111111107, "points") == "24.4" and _fmt(None) == "n/a" and _fmt(7) == "7"


def test_csv_tables_are_written_rounded(tmp_path):
    table = pd.DataFrame({"variant": ["a", "b"], "n": [3, 4], "accuracy": [24.361111111111107, float("nan")]})
    rounded = round_frame(table)
    assert rounded["accuracy"].iloc[0] == 24.36111111 and math.isnan(rounded["accuracy"].iloc[1])
    assert rounded["n"].dtype == table["n"].dtype and table["accuracy"].iloc[0] == 24.361111111111107  # a copy
    paths = write_pilot_summary(table, tmp_path)
    assert paths["csv"].read_text() == "variant,n,accuracy\na,3,24.36111111\nb,4,\n"
