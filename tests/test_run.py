"""The runner: bad configs and missing models fail in one line before anything is written, records are complete,
deterministic and resumable."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import compose
from kvcert.config import ConfigError, result_name
from kvcert.records import EXAMPLE_COLUMNS, STEP_COLUMNS
from kvcert.run import run_cell

ROOT = Path(__file__).resolve().parents[1]


def test_cli_bad_config_and_missing_model_fail_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "kvcert.run", f"results_dir={tmp_path}", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )

    bad = run("budget=2.0")
    assert bad.returncode == 2
    expected = "error: budget=2.0; a budget is the kept fraction of the prompt, in (0, 1]"
    assert bad.stderr.strip().splitlines() == [expected]
    missing = run("model=hf", f"model.name={tmp_path}/no-such-model")
    assert missing.returncode == 2
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "no-such-model" in lines[0]
    assert not any(tmp_path.iterdir())  # nothing written for a run that could not start


TINY = [
    "task.tasks=[single_needle,fact_qa]",
    "task.n_examples=2",
    "task.context_tokens=[160]",
    "budget=0.5",
    "decode.max_new_tokens=4",
    "threads=1",
    "policy.grid=[{scorer: window_question, designs: [topk, randomized, randomized_no_offset, uniform]},"
    "{scorer: window_context, designs: [randomized]}, {scorer: streaming, designs: [topk]}]",
]


def _cell(tmp_path, tiny_smol, extra=(), after_shard=None):
    cfg = compose([f"results_dir={tmp_path}", *TINY, *extra])
    model, tok = tiny_smol
    return run_cell(cfg, model=model, tokenizer=tok, after_shard=after_shard)


def _frames(run_dir):
    return pd.read_parquet(run_dir / "examples.parquet"), pd.read_parquet(run_dir / "steps.parquet")


def test_records_have_the_schema_and_one_row_per_example_and_variant(tmp_path, tiny_smol):
    run_dir = _cell(tmp_path, tiny_smol)
    ex, steps = _frames(run_dir)
    assert list(ex.columns) == EXAMPLE_COLUMNS and list(steps.columns) == STEP_COLUMNS
    assert len(ex) == 4 * 7 and ex.groupby("example_id").variant.nunique().eq(7).all()
    full = ex[ex.design == "full"].set_index("example_id").correct
    assert (ex.full_correct == ex.example_id.map(full)).all()
    assert ex.loc[ex.design == "topk", "cert_score"].isna().all()  # undefined, never zero
    cert = ex[ex.has_certificate & (ex.n_answer_tokens > 0)]
    assert cert.cert_score.notna().all() and (cert.cert_score > 0).all()
    assert (cert.steps95 <= cert.steps_total).all()
    assert not ex.nonfinite.any()
    assert (ex.loc[ex.design == "full", "rel_error_mean"] < 1e-4).all()
    for name in ["config.yaml", "provenance.json", "COMPLETE"]:
        assert (run_dir / name).exists()
    assert run_dir.name == result_name(compose([f"results_dir={tmp_path}", *TINY]))


def test_same_config_same_records(tmp_path, tiny_smol):
    a = _frames(_cell(tmp_path / "a", tiny_smol))
    b = _frames(_cell(tmp_path / "b", tiny_smol))
    pd.testing.assert_frame_equal(a[0], b[0])
    pd.testing.assert_frame_equal(a[1], b[1])


def test_killed_run_resumes_to_exactly_the_uninterrupted_rows(tmp_path, tiny_smol, capsys):
    reference = _frames(_cell(tmp_path / "ref", tiny_smol))

    def crash_after_two(written):
        if written >= 2:
            raise RuntimeError(f"simulated crash after {written} shards")

    with pytest.raises(RuntimeError, match="simulated crash"):
        _cell(tmp_path / "kill", tiny_smol, after_shard=crash_after_two)
    run_dir = next((tmp_path / "kill").iterdir())
    assert len(list((run_dir / "shards").glob("*.examples.parquet"))) == 2
    assert not (run_dir / "COMPLETE").exists()
    (run_dir / "shards" / "000002.examples.parquet.tmp").write_bytes(b"half a file")  # a kill mid-write
    resumed = _frames(_cell(tmp_path / "kill", tiny_smol))
    pd.testing.assert_frame_equal(resumed[0], reference[0])
    pd.testing.assert_frame_equal(resumed[1], reference[1])
    capsys.readouterr()
    _cell(tmp_path / "kill", tiny_smol)
    assert "complete, skipped" in capsys.readouterr().out


def test_a_folder_with_another_config_is_refused(tmp_path, tiny_smol):
    run_dir = _cell(tmp_path, tiny_smol)
    (run_dir / "config.yaml").write_text("something else\n")
    before = (run_dir / "examples.parquet").read_bytes()
    with pytest.raises(ConfigError, match="different config"):
        _cell(tmp_path, tiny_smol)
    assert (run_dir / "examples.parquet").read_bytes() == before


def test_a_folder_saved_before_a_default_only_key_existed_is_the_same_config(tmp_path, tiny_smol, capsys):
    """A key added to the schema later (at its default) neither renames nor orphans a folder: its saved config lacks
    the key and still matches; a saved config that states another value of a hashed key is refused."""
    import yaml

    run_dir = _cell(tmp_path, tiny_smol)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["decode"]["tight_radius_every"]  # as written before the key existed
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    capsys.readouterr()
    assert _cell(tmp_path, tiny_smol) == run_dir
    assert "complete, skipped" in capsys.readouterr().out
    saved["decode"]["oracle"] = not saved["decode"]["oracle"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="different config"):
        _cell(tmp_path, tiny_smol)
