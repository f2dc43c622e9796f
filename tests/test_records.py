"""Records: scoring and full_correct belong to the records, step rows have one row per (step, layer, head),
shards are atomic."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvcert.hf.decode import VariantResult
from kvcert.policy import FULL, Policy
from kvcert.records import EXAMPLE_COLUMNS, STEP_COLUMNS, example_frame, step_frame
from kvcert.shards import ShardStore
from kvcert.tasks.ruler import Example


def _example():
    return Example(
        id="ex1",
        task="single_needle",
        context="c",
        question="q",
        answers=("42",),
        depth=0.5,
        metric="ruler_all",
        target_tokens=100,
    )


def _result(policy, answer, steps=2, layers=3, heads=4, var=0.01):
    shape = (steps, layers, heads)
    stats = {
        "error": np.full(shape, 0.05, np.float32),
        "out_norm": np.ones(shape, np.float32),
        "tail_mass": np.full(shape, 0.1, np.float32),
        "p_max": np.full(shape, 0.2, np.float32),
        "variance": np.full(shape, var if policy.has_certificate else np.nan, np.float32),
    }
    return VariantResult(
        policy=policy,
        tokens=[1] * steps,
        logprobs=[-0.5] * steps,
        n_answer=steps,
        answer=answer,
        kept_tokens=10.0,
        stats=stats,
    )


def test_example_frame_scores_and_sets_full_correct_from_the_full_variant():
    pol = Policy(scorer="window_question", design="randomized", budget=0.5)
    df = example_frame("run", _example(), 100, [_result(FULL, "42"), _result(pol, "17")])
    assert list(df.columns) == EXAMPLE_COLUMNS
    assert df.correct.tolist() == [True, False] and df.full_correct.tolist() == [True, True]
    # radius 1.96 * 0.1 = 0.196 >= error 0.05 in every cell
    assert df.covered95.iloc[1] == 1.0 and df.steps_total.iloc[1] == 2 * 3 * 4
    assert np.isnan(df.cert_score.iloc[0])  # the full cache estimates nothing: undefined, never zero
    with pytest.raises(ValueError, match="no full-cache variant"):
        example_frame("run", _example(), 100, [_result(pol, "42")])


def test_step_frame_one_row_per_step_layer_head():
    pol = Policy(scorer="window_question", design="randomized", budget=0.5)
    df = step_frame("run", "ex1", [_result(FULL, "42"), _result(pol, "17", var=0.04)])
    assert list(df.columns) == STEP_COLUMNS and len(df) == 2 * (2 * 3 * 4)
    rand = df[df.variant == pol.label]
    assert np.allclose(rand.radius95, 1.959964 * 0.2, atol=1e-5)
    assert rand[["step", "layer", "head"]].drop_duplicates().shape[0] == 24


def test_shard_store_marks_complete_only_when_every_shard_exists(tmp_path):
    store = ShardStore(tmp_path / "cell").open()
    frame = pd.DataFrame({"a": [1]})
    store.write(0, frame, frame)
    (store.shards / "000001.examples.parquet.tmp").write_bytes(b"half")  # a kill mid-write
    _, n = store.merge(expected=2)
    assert n == 1 and not store.complete
    store.open()  # the next run removes what the killed one left
    assert not list(store.run_dir.rglob("*.tmp"))
    store.write(1, frame, None)
    store.merge(expected=2)
    assert store.complete and len(pd.read_parquet(store.run_dir / "examples.parquet")) == 2


def test_step_rows_carry_the_tight_radius_and_the_regime_flag(tiny_smol):
    """On a real decode: the tight radius lies between 1/1.96 and 1 times the conservative one (effective dimension
    between d and 1), the diagnostics are consistent, and cells without a certificate carry NaN, never 0."""
    import torch

    from kvcert.hf import DecodeOptions, Prompt, generate_variants

    model, _ = tiny_smol
    ids = torch.randint(100, 5000, (160,), generator=torch.Generator().manual_seed(3)).tolist()
    pols = [
        FULL,
        Policy(scorer="window_question", design="randomized", budget=0.4, seed=1),
        Policy(scorer="streaming", design="topk", budget=0.4),
    ]
    res = generate_variants(
        model, None, Prompt(input_ids=ids, question_start=130, example_id="t"), pols, DecodeOptions(max_new_tokens=4)
    )
    df = step_frame("run", "t", res)
    rand = df[df.variant == pols[1].label]
    ratio = rand.radius95_tight / rand.radius95
    assert ((ratio > 0.5) & (ratio <= 1.0001)).all()
    assert (rand.n_tail > 0).all() and (rand.ess_tail <= rand.n_tail + 1e-3).all() and (rand.ess_tail >= 1).all()
    assert np.allclose(rand.tail_mass + rand.head_mass, 1 - 0, atol=0.2)  # the rest is the appended tokens
    assert (rand.tail_max <= rand.tail_mass + 1e-3).all()
    assert rand.certificate_trusted.dtype == bool
    for name in ("radius95_tight", "trace_c2", "ess_tail"):
        assert df.loc[df.variant != pols[1].label, name].isna().all(), name
    assert (df.loc[df.variant != pols[1].label, "n_tail"] == -1).all()
    assert not df.loc[df.variant != pols[1].label, "certificate_trusted"].any()


def test_provenance_names_the_cpu_and_the_thread_count(tmp_path):
    """Bit-identity of records holds only on the CPU type that made them: provenance says which."""
    import torch

    from kvcert.records import cpu_model, provenance

    prov = provenance(tmp_path, {"seed": 0}, None)
    assert prov["cpu"] == cpu_model() and isinstance(prov["cpu"], str) and prov["cpu"]
    assert prov["torch_threads"] == torch.get_num_threads()
    assert prov["seeds"] == {"seed": 0} and "torch" in prov["packages"]


def test_atomic_writes_fsync_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """A shard survives a power loss: its bytes are on disk before the rename makes it visible, and the rename is
    on disk (the folder fsync'ed) before the next file is written."""
    import os
    import stat

    from kvcert.shards import atomic_parquet, atomic_text

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append(f"replace {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    frame = pd.DataFrame({"a": [1, 2]})
    atomic_parquet(frame, tmp_path / "x.parquet")
    assert events == ["fsync file", "replace x.parquet", "fsync dir"]
    events.clear()
    atomic_text("hello", tmp_path / "COMPLETE")
    assert events == ["fsync file", "replace COMPLETE", "fsync dir"]
    assert (tmp_path / "COMPLETE").read_text() == "hello" and pd.read_parquet(tmp_path / "x.parquet").equals(frame)
    events.clear()
    ShardStore(tmp_path / "cell").open().write(0, frame, frame)
    assert events == ["fsync file", "replace 000000.steps.parquet", "fsync dir"] + [
        "fsync file",
        "replace 000000.examples.parquet",
        "fsync dir",
    ]
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_folder_that_cannot_be_fsynced_is_best_effort(tmp_path, monkeypatch):
    import os

    from kvcert.shards import atomic_text, fsync_dir

    real_open = os.open

    def no_dirs(path, flags, *args):
        if Path(path).is_dir():
            raise PermissionError("folders cannot be opened here")  # as on Windows
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_dirs)
    fsync_dir(tmp_path)
    atomic_text("x", tmp_path / "a.txt")
    assert (tmp_path / "a.txt").read_text() == "x"


def _three_shards(tmp_path):
    store = ShardStore(tmp_path / "cell").open()
    for i in range(3):
        store.write(i, pd.DataFrame({"i": [i], "v": ["ex"]}), pd.DataFrame({"i": [i] * 4, "step": range(4)}))
    return store


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return data[: int(len(data) * keep)]


def test_an_unreadable_shard_is_moved_aside_with_its_sibling_and_named_in_one_line(tmp_path):
    store = _three_shards(tmp_path)
    bad = store.shards / "000001.examples.parquet"
    cut = _truncate(bad)
    good = {f.name: f.read_bytes() for f in store.shards.glob("00000[02].*")}
    warnings = store.check(expect_steps=True)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    line = warnings[0]
    assert line.startswith(f"warning: shard {bad} is unreadable (Parquet magic bytes not found in footer")
    (folder,) = (store.shards / "corrupt").iterdir()
    assert f"moved 000001.steps.parquet, 000001.examples.parquet to {folder}/" in line
    assert (folder / "000001.examples.parquet").read_bytes() == cut  # kept as it was, never deleted
    assert (folder / "000001.steps.parquet").exists()
    assert not store.is_done(1) and not (store.shards / "000001.steps.parquet").exists()
    assert {f.name: f.read_bytes() for f in store.shards.glob("00000[02].*")} == good  # the others untouched
    assert store.check(expect_steps=True) == []  # nothing else to move; the corrupt/ folder is not a shard
    store.write(1, pd.DataFrame({"i": [1], "v": ["ex"]}), pd.DataFrame({"i": [1] * 4, "step": range(4)}))
    examples, n = store.merge(expected=3)
    assert n == 3 and store.complete and examples.i.tolist() == [0, 1, 2]


def test_an_unreadable_or_missing_steps_shard_marks_its_example_not_done(tmp_path):
    store = _three_shards(tmp_path)
    (store.shards / "000000.steps.parquet").write_bytes(b"")  # a power loss after an un-synced rename
    (store.shards / "000002.steps.parquet").unlink()
    assert store.check(expect_steps=False)[0].startswith(
        f"warning: shard {store.shards / '000000.steps.parquet'} is unreadable (Parquet file size is 0 bytes)"
    )
    assert not store.is_done(0) and store.is_done(2)  # without step records a missing steps shard is no fault
    (line,) = store.check(expect_steps=True)
    assert "000002.examples.parquet is unreadable (its steps shard 000002.steps.parquet is missing)" in line
    assert not store.is_done(2) and store.is_done(1)
    moved = sorted(f.name for f in (store.shards / "corrupt").rglob("*.parquet"))
    assert moved == ["000000.examples.parquet", "000000.steps.parquet", "000002.examples.parquet"]


def test_a_shard_unreadable_past_its_footer_fails_the_merge_in_one_line_and_is_redone(tmp_path, monkeypatch):
    from kvcert.shards import ShardError

    store = _three_shards(tmp_path)
    bad = store.shards / "000002.steps.parquet"
    real = pd.read_parquet

    def read(path, *args, **kwargs):
        if Path(path) == bad:
            raise OSError("Couldn't deserialize thrift: TProtocolException: Invalid data\nDeserializing page header")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(pd, "read_parquet", read)
    with pytest.raises(ShardError) as err:
        store.merge(expected=3)
    assert "\n" not in str(err.value) and f"shard {bad} is unreadable (Couldn't deserialize thrift" in str(err.value)
    assert str(err.value).endswith("; rerun to redo its example")
    assert not store.is_done(2) and not store.complete
    assert len(list((store.shards / "corrupt").rglob("000002.*"))) == 2


def test_a_complete_folder_with_an_unreadable_merged_file_is_merged_again(tmp_path):
    store = _three_shards(tmp_path)
    store.merge(expected=3)
    reference = (store.run_dir / "examples.parquet").read_bytes()
    assert store.check_merged() == []
    cut = _truncate(store.run_dir / "examples.parquet", keep=0.9)
    (line,) = store.check_merged()
    assert line.startswith(f"warning: {store.run_dir / 'examples.parquet'} is unreadable (")
    assert "moved examples.parquet, COMPLETE to" in line and not store.complete
    (folder,) = (store.run_dir / "corrupt").iterdir()
    assert (folder / "examples.parquet").read_bytes() == cut and (folder / "COMPLETE").exists()
    store.open()
    assert store.check() == []
    store.merge(expected=3)
    assert store.complete and (store.run_dir / "examples.parquet").read_bytes() == reference
