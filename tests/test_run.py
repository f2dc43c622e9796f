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


def _crash_after(n):
    def after_shard(written):
        if written >= n:
            raise RuntimeError(f"simulated crash after {written} shards")

    return after_shard


def _warnings(stderr: str) -> list[str]:
    """The shard warnings (the tiny random model's full cache scores 0: that line is another matter)."""
    lines = stderr.splitlines()
    return [x for x in lines if x.startswith("[kvcert] warning:") and "the full cache scored 0" not in x]


def _no_duplicates(frames):
    ex, steps = frames
    assert not ex.duplicated(["example_id", "variant"]).any()
    assert not steps.duplicated(["example_id", "variant", "step", "layer", "head"]).any()


def test_a_truncated_shard_is_named_moved_aside_and_redone(tmp_path, tiny_smol, capsys):
    """Resuming with an unreadable shard (truncated by hand, or cut by a power loss after an un-synced rename): one
    warning line names it, it is moved to shards/corrupt/ (not deleted) with its steps shard, its example is redone,
    and the records equal an uninterrupted run's. A complete folder whose merged file is unreadable is merged again."""
    reference = _frames(_cell(tmp_path / "ref", tiny_smol))
    with pytest.raises(RuntimeError, match="simulated crash"):
        _cell(tmp_path / "cut", tiny_smol, after_shard=_crash_after(2))
    run_dir = next((tmp_path / "cut").iterdir())
    shard = run_dir / "shards" / "000000.examples.parquet"
    cut = shard.read_bytes()[: shard.stat().st_size // 2]
    shard.write_bytes(cut)
    capsys.readouterr()
    resumed = _frames(_cell(tmp_path / "cut", tiny_smol))
    (line,) = _warnings(capsys.readouterr().err)
    assert f"shard {shard} is unreadable (Parquet magic bytes not found in footer" in line
    (folder,) = (run_dir / "shards" / "corrupt").iterdir()
    assert f"moved 000000.steps.parquet, 000000.examples.parquet to {folder}/; its example is redone" in line
    assert (folder / "000000.examples.parquet").read_bytes() == cut and (folder / "000000.steps.parquet").exists()
    pd.testing.assert_frame_equal(resumed[0], reference[0])
    pd.testing.assert_frame_equal(resumed[1], reference[1])
    _no_duplicates(resumed)

    merged = run_dir / "steps.parquet"
    merged.write_bytes(merged.read_bytes()[:100])
    again = _frames(_cell(tmp_path / "cut", tiny_smol))
    (line,) = _warnings(capsys.readouterr().err)
    assert line.startswith(f"[kvcert] warning: {merged} is unreadable (") and "merged again" in line
    assert len(list((run_dir / "corrupt").rglob("steps.parquet"))) == 1
    pd.testing.assert_frame_equal(again[1], reference[1])
    assert (run_dir / "COMPLETE").exists()


def test_an_empty_saved_config_is_refused_in_one_line(tmp_path, tiny_smol):
    cfg = compose([f"results_dir={tmp_path}", *TINY])
    run_dir = tmp_path / result_name(cfg)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("")  # a power loss after an un-synced write
    with pytest.raises(ConfigError, match="config.yaml is empty or not YAML") as err:
        run_cell(cfg, model=tiny_smol[0], tokenizer=tiny_smol[1])
    assert "\n" not in str(err.value) and sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


def test_a_sigkilled_cli_run_reruns_to_the_records_of_a_clean_run(tmp_path, tiny_smol):
    """`kvcert-run` killed with SIGKILL once its first shard is on disk, then run again: the records equal a clean
    run's, without duplicates."""
    import os
    import signal
    import time

    from kvcert.hf import load_model

    model, tok = tiny_smol
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    args = [f"results_dir={tmp_path / 'runs'}", *TINY, "task.n_examples=3", "model=hf", f"model.name={folder}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "kvcert.run", *args, f"hydra.run.dir={tmp_path / 'hydra'}"]
    run_dir = tmp_path / "runs" / result_name(compose(args))
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not list((run_dir / "shards").glob("*.examples.parquet")):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no shard within 240 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "COMPLETE").exists()
    assert 1 <= len(list((run_dir / "shards").glob("*.examples.parquet"))) < 6
    rerun = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert not _warnings(rerun.stderr)  # a kill leaves no unreadable shard
    killed = _frames(run_dir)

    clean_model, clean_tok = load_model(str(folder))
    clean = _frames(
        run_cell(compose([*args[1:], f"results_dir={tmp_path / 'clean'}"]), model=clean_model, tokenizer=clean_tok)
    )
    assert len(killed[0]) == 6 * 7
    pd.testing.assert_frame_equal(killed[0], clean[0])
    pd.testing.assert_frame_equal(killed[1], clean[1])
    _no_duplicates(killed)
