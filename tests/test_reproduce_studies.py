"""Study selection in kvcert.reproduce: study 1's settings are today's, a nested claim option (study2/<name>)
composes, and `run --study study2` runs its claims with pinned threads and a progress log (on a temporary conf tree
with a study-2 claim folder, since conf/claim/study2/ is the lead's to add)."""

import shutil
from pathlib import Path

import pytest
import torch
import yaml

import kvcert.reproduce as rep
from kvcert.analysis.claims import registry
from kvcert.config import result_name

TINY = [
    "task.tasks=[single_needle]",
    "task.n_examples=1",
    "task.context_tokens=[160]",
    "decode.max_new_tokens=2",
    "policy.grid=[{scorer: window_question, designs: [randomized]}]",
]


def test_study1_settings_are_the_confirmatory_profile():
    st = rep.settings("study1")
    assert st["out"] == rep.ROOT / "results" and st["predictions"] == rep.PREDICTIONS
    assert st["overrides"] == [*rep.PROFILES["confirmatory"]["overrides"], "threads=1"]
    assert st["t1_draws"] is None
    smoke = rep.settings("study1", "smoke")
    assert smoke["out"] == rep.PROFILES["smoke"]["out"]
    assert smoke["overrides"] == [*rep.PROFILES["smoke"]["overrides"], "threads=1"]
    assert smoke["t1_draws"] == rep.PROFILES["smoke"]["t1_draws"]
    # the pinned thread count (that of study 1's published records) changes no result folder
    before = rep.compose_claim("c1_coverage", rep.PROFILES["confirmatory"]["overrides"])
    after = rep.compose_claim("c1_coverage", st["overrides"])
    assert after.threads == 1 and result_name(before) == result_name(after)
    assert list(registry(st["predictions"], st["claims"])) == list(registry())
    s2 = rep.settings("study2", "smoke")
    assert s2["out"] == rep.ROOT / "results" / "study2" / "smoke"
    assert s2["overrides"][-1] == "threads=2"
    assert f"results_dir={s2['out'] / 'runs'}" in s2["overrides"]
    with pytest.raises(ValueError, match="unknown study"):
        rep.settings("study3")


@pytest.fixture
def study2_tree(tmp_path, monkeypatch):
    """A copy of conf/ with claim/study2/{c1_fast,t1_fast}.yaml and a two-claim predictions file."""
    conf = tmp_path / "conf"
    shutil.copytree(rep.CONF, conf, ignore=shutil.ignore_patterns("study2"))
    (conf / "claim" / "study2").mkdir()
    c1 = (conf / "claim" / "c1_coverage.yaml").read_text().replace("seed: 0 ", "seed: 2000 ")
    assert "seed: 2000" in c1 and c1.startswith("# @package _global_")
    (conf / "claim" / "study2" / "c1_fast.yaml").write_text(c1)
    t1 = (conf / "claim" / "t1_nonidentifiability.yaml").read_text().replace("draws: 2000", "draws: 20")
    (conf / "claim" / "study2" / "t1_fast.yaml").write_text(t1.replace("n: 1000", "n: 200"))
    predictions = tmp_path / "predictions.yaml"
    predictions.write_text(yaml.safe_dump({"claims": {"C1": {"analysis": "coverage"}, "T1": {"analysis": "t1"}}}))
    out = tmp_path / "out"
    monkeypatch.setattr(rep, "CONF", conf)
    entry = {
        **rep.STUDIES["study2"],
        "predictions": predictions,
        "claims": conf / "claim" / "study2",
        "out": out,
        "overrides": [*rep.STUDIES["study2"]["overrides"], *TINY, f"results_dir={tmp_path / 'runs'}"],
        "threads": 1,  # not the process's 2 threads, so that pinning is visible
    }
    monkeypatch.setitem(rep.STUDIES, "study2", entry)
    return entry


def test_nested_claim_option_composes(study2_tree):
    cfg = rep.compose_claim("study2/c1_fast", rep.settings("study2")["overrides"])
    assert cfg.claim.id == "C1" and cfg.seed == 2000 and cfg.threads == 1
    assert cfg.decode.backend == "auto"
    assert list(cfg.task.tasks) == ["single_needle"]  # the claim's `override /task` applied, then the overrides
    # study 1's registry reads the top level only: the nested folder is not one of its experiments
    assert "c1_fast" not in {e.experiment for e in registry(rep.PREDICTIONS, rep.CONF / "claim").values()}


def test_run_study2_pins_threads_and_logs(study2_tree, tiny_smol, monkeypatch, torch_threads):
    model, tok = tiny_smol
    real_run_cell = rep.run_cell
    seen = []

    def run_cell(cfg, *, log=None):
        seen.append((cfg.claim.id, cfg.seed, torch.get_num_threads(), log))
        return real_run_cell(cfg, model=model, tokenizer=tok, log=log)

    threads_seen = []
    real_t1 = rep.t1_from_config

    def t1_from_config(cfg, draws=None):
        threads_seen.append(torch.get_num_threads())
        return real_t1(cfg, draws)

    monkeypatch.setattr(rep, "run_cell", run_cell)
    monkeypatch.setattr(rep, "t1_from_config", t1_from_config)
    torch_threads(2)  # restored after the test, whatever the runs pinned
    assert rep.main(["run", "--study", "study2", "--only", "T1"]) == 0
    assert threads_seen == [1]  # T1 alone: pinned, not inherited
    assert rep.main(["run", "--study", "study2"]) == 0
    assert rep.main(["run", "--study", "study2"]) == 0  # resume
    log = study2_tree["out"] / "reproduce.log"
    assert [s[:2] for s in seen] == [("C1", 2000)] * 2 and all(s[3] == log for s in seen)
    assert (study2_tree["out"] / "tables" / "t1.json").exists()
    text = log.read_text()
    assert text.count("study2 (confirmatory): 2 claims, 1 threads") == 3
    assert text.count("C1 (c1_fast) -> ") == 2 and text.count("C1: done in ") == 2
    assert text.count(": shard ") == 1 and text.count(": complete: 1 examples") == 1
    assert text.count("skipped: complete") == 1
    assert text.count("T1 (t1_fast): start, 1 threads") == 3 and text.count("T1: 5 lambdas in") == 3


def test_all_runs_each_study(monkeypatch):
    calls = []
    monkeypatch.setattr(rep, "run_claims", lambda profile, only=None, *, study: calls.append(("run", study)))
    monkeypatch.setattr(rep, "analyze", lambda profile, *, study: calls.append(("analyze", study)) or {"id": study})
    monkeypatch.setattr(rep, "publish", lambda profile, *, study, into=None: calls.append(("publish", study)))
    monkeypatch.setattr(rep, "combine", lambda cards, profile: calls.append(("combine", sorted(cards))))
    assert rep.main(["analyze", "--study", "all"]) == 0
    assert rep.main(["run"]) == 0
    assert rep.main(["publish", "--study", "study2"]) == 0
    # a study-3 model is analysed once its records are published (they are committed); studies 1-2 always
    analysed = [s for s in rep.STUDIES if not s.startswith("study3") or rep.settings(s)["published"].exists()]
    assert calls == [
        *[("analyze", s) for s in analysed],
        ("combine", sorted(analysed)),  # the combined scorecard once studies 1 and 2 were analysed
        ("run", "study1"),
        ("publish", "study2"),
    ]
    assert {"study1", "study2"} <= set(analysed)
    assert Path(rep.STUDIES["study2"]["claims"]).name == "study2"


def test_study2_claims_share_one_pinned_cell_with_study2_seeds():
    """Every study-2 claim composes to one results folder (one run), seed 2000, 1k/2k/4k, threads 2, no ablation."""
    st = rep.settings("study2")
    claims = registry(st["predictions"], st["claims"])
    assert list(claims) == ["C1", "C2", "C3", "C4", "C5", "C6", "C7", "T1"]
    names = set()
    for cid, entry in claims.items():
        cfg = rep.compose_claim(st["prefix"] + entry.experiment, st["overrides"])
        assert cfg.threads == 2 and cfg.claim.id == cid
        if cid == "T1":
            assert 2000 <= cfg.claim.t1.seed <= 2999
            continue
        assert cfg.seed == 2000 and list(cfg.task.context_tokens) == [1000, 2000, 4000]
        assert cfg.task.n_examples == 24 and len(cfg.task.tasks) == 5
        assert {d for g in cfg.policy.grid for d in g.designs} == {"topk", "randomized"}
        names.add(result_name(cfg))
    assert len(names) == 1 and "s2000" in names.pop()
