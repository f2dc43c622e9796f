"""`kvcert report` and a user's multirun (issue #54): a Hydra multirun over budgets of a tiny random model on a
JSON-lines file of one's own, under +debug=smoke, says what the profile changes, gives each job its own folder and
ends in report.{md,png,html} built from the records alone; a Hydra typo exits 2 naming the nearest key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvcert.report import ReportError, cell_folders, report_table, write_report

ROOT = Path(__file__).resolve().parents[1]


def _kvcert_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "kvcert.run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


@pytest.fixture(scope="module")
def multirun(tmp_path_factory, smol_tokenizer):
    """A user's sweep: a tiny random llama saved as a model folder (the packaged tokenizer), 3 rows of JSON lines,
    `kvcert-run -m ... budget=0.25,0.5 +debug=smoke`."""
    from kvcert.hf import tiny_random_model

    tmp = tmp_path_factory.mktemp("multirun")
    model, _ = tiny_random_model("llama", vocab_size=len(smol_tokenizer), max_position_embeddings=4096)
    model.save_pretrained(tmp / "model")
    smol_tokenizer.save_pretrained(tmp / "model")
    row = {"context": "Anna planted tulips, roses and a single fig tree by the old garden wall.",
           "question": "Which tree did Anna plant?", "answers": ["fig"]}  # fmt: skip
    (tmp / "mine.jsonl").write_text("".join(json.dumps(row) + "\n" for _ in range(3)))
    data = tmp / "mine.jsonl"
    done = _kvcert_run("-m", "model=hf", f"model.name={tmp / 'model'}", "task=jsonl", f"task.path={data}",
                       "budget=0.25,0.5", "+debug=smoke", f"results_dir={tmp / 'runs'}",
                       f"hydra.sweep.dir={tmp / 'multi'}", "threads=1", "decode.max_new_tokens=2",
                       "hydra/job_logging=disabled", cwd=tmp)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, done


def test_a_debug_profile_says_what_it_changes_and_each_job_keeps_its_own_folder(multirun):
    tmp, done = multirun
    said = [x for x in done.stdout.splitlines() if x.startswith("[kvcert] debug profile smoke sets: ")]
    assert len(said) == 2, done.stdout  # once per job
    assert "task.n_examples=2" in said[0] and "decode.max_new_tokens=2" in said[0]
    assert "task.tasks=" in said[0] and "(unused by task.dataset=jsonl)" in said[0]
    assert "budgets.fractions=[0.5] (unused: budget=0.25 is set)" in said[0]
    cells = sorted(p.name for p in (tmp / "runs").iterdir())
    assert len(cells) == 2 and {c.split("__")[4] for c in cells} == {"b0.25", "b0.5"}  # no shared debug-smoke
    assert "holds records of a different config" not in done.stderr


def test_a_multirun_ends_in_a_report_from_its_records(multirun):
    tmp, done = multirun
    out = tmp / "multi"
    assert f"report of the multirun: {out / 'report.md'}" in done.stdout
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| full cache " in md and "accuracy [95% CI]" in md and "coverage of the 95% radius" in md
    assert "KV held" in md and "window_question/randomized t0.5 f0.2 p1" in md
    assert "data:image/png;base64," in html and "<img" in html and "src='report.png'" not in html  # self-contained
    examples = pd.concat(pd.read_parquet(c / "examples.parquet") for c in cell_folders(out))
    table = report_table(examples)
    assert table.iloc[0]["policy"] == "full cache" and table.iloc[0]["examples"] == 2  # n_examples=2 (the profile)
    rows = table[table["policy"] == "window_question/randomized t0.5 f0.2 p1"]
    assert list(rows["budget"]) == [0.25, 0.5] and rows["coverage"].between(0, 1).all()
    assert (rows["kv_held"] < 1).all() and (rows["full_accuracy"] == table.iloc[0]["accuracy"]).all()
    # the same report from the runs folder, and a folder without records is one line
    again = write_report(tmp / "runs", tmp / "again")
    assert again["md"].read_text().split("\n", 1)[1] == md.split("\n", 1)[1]
    with pytest.raises(ReportError, match="no records under"):
        write_report(tmp / "model")


def test_a_hydra_typo_exits_2_naming_the_nearest_key(tmp_path):
    from kvcert.run import check_overrides as check_with
    from kvcert.run import config_dir

    def check_overrides(args: list[str]) -> str | None:
        return check_with(args, config_dir())

    done = _kvcert_run("budgett=0.25", cwd=tmp_path)
    assert done.returncode == 2 and "To append to your config" not in done.stderr
    assert "unknown config key 'budgett' in budgett=0.25: did you mean budget?" in done.stderr
    assert "did you mean decode.max_new_tokens?" in check_overrides(["decode.max_new_token=4"])
    problem = check_overrides(["model=smollm3"])
    assert "did you mean model=smollm2?" in problem and "gemma3" in problem and "smollm2-135m-instruct" in problem
    ok = [
        "-m",
        "budget=0.25,0.5",
        "seed=0,1",
        "model=gemma3",
        "model=hf",
        "model.name=x/y",
        "+debug=smoke",
        "+claim=c1_coverage",
        "claim=study2/c1_coverage",
        "policy.grid=[{scorer: streaming, designs: [topk]}]",
        "task.fields.context=passage",
        "+task.difficulty.fact_qa=19",
        "task.tasks=[fact_qa]",
        "hydra/launcher=submitit_local",
        "hydra.sweep.dir=x",
        "hydra/job_logging=disabled",
        "records.steps=none",
    ]
    assert check_overrides(ok) is None


@pytest.mark.parametrize("name", ["smollm2", "smollm2-135m-instruct", "gemma3", "gemma3-270m", "gemma3_270m"])
def test_every_model_name_works_in_the_api_the_cli_and_hydra(name):
    from conftest import compose
    from kvcert.hf.loading import EMBEDDED_MODELS, resolve_name
    from kvcert.serve.cli import _model_name

    packaged = resolve_name(name)  # kvcert.load_model's resolution
    assert packaged in EMBEDDED_MODELS and _model_name(name) == packaged  # kvcert generate --model
    assert compose([f"model={name}"]).model.name == packaged  # kvcert-run model=<name>


def test_an_unknown_model_names_the_packaged_ones(monkeypatch):
    from kvcert.hf import loading

    err = loading._load_error("smollm3", OSError("not found"), True, "offline mode is on (HF_HUB_OFFLINE=1)")
    assert "did you mean smollm2?" in str(err) and "gemma3 (gemma3-270m)" in str(err) and "\n" not in str(err)
    assert "smollm2 (smollm2-135m-instruct)" in loading.packaged_names()
