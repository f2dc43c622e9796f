"""Records: scoring and full_correct belong to the records, step rows have one row per (step, layer, head),
shards are atomic."""

import numpy as np
import pandas as pd
import pytest

from kvcert.hf.decode import VariantResult
from kvcert.policy import FULL, Policy
from kvcert.records import EXAMPLE_COLUMNS, STEP_COLUMNS, ShardStore, example_frame, step_frame
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
