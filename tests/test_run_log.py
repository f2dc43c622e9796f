"""run_cell's progress log (log=): timestamped start, shard, complete and skipped lines, appended and flushed."""

import re
from datetime import datetime

from conftest import compose
from kvcert.run import progress, run_cell

TINY = [
    "task.tasks=[single_needle]",
    "task.n_examples=2",
    "task.context_tokens=[160]",
    "budget=0.5",
    "decode.max_new_tokens=3",
    "threads=1",
    "policy.grid=[{scorer: window_question, designs: [topk, randomized]}]",
]


def _lines(path):
    lines = path.read_text().splitlines()
    for line in lines:  # every line starts with an ISO timestamp
        stamp, rest = line.split(" ", 1)
        datetime.fromisoformat(stamp)
        assert rest.startswith("[kvcert] ")
    return lines


def test_run_cell_logs_start_shards_complete_and_resume(tmp_path, tiny_smol, capsys):
    cfg = compose([f"results_dir={tmp_path / 'runs'}", *TINY])
    model, tok = tiny_smol
    log = tmp_path / "logs" / "reproduce.log"
    run_dir = run_cell(cfg, model=model, tokenizer=tok, log=log)
    lines = _lines(log)
    assert f"start in {run_dir}: 2 examples, 2 shards to write (0 already written)" in lines[0]
    shards = [x for x in lines if ": shard " in x]
    assert len(shards) == 2
    assert re.search(r"shard \d+ done: 1/2 examples, elapsed \d+m\d\ds, ETA \d+m\d\ds$", shards[0])
    assert "2/2 examples" in shards[1]
    assert re.search(r": complete: 2 examples in \d+m\d\ds$", lines[-1])
    assert "(step, layer, head) cells" in lines[-2]  # the summary line printed today is logged too

    capsys.readouterr()
    run_cell(cfg, model=model, tokenizer=tok, log=log)
    assert "complete, skipped" in capsys.readouterr().out  # stdout unchanged
    again = _lines(log)
    assert again[: len(lines)] == lines  # appended, never rewritten
    assert len(again) == len(lines) + 1 and again[-1].endswith(f"skipped: complete ({run_dir})")


def test_progress_without_log_only_prints(tmp_path, capsys):
    progress("hello")
    progress("quiet", tmp_path / "x.log", echo=False)
    assert capsys.readouterr().out == "[kvcert] hello\n"
    assert _lines(tmp_path / "x.log")[0].endswith("[kvcert] quiet")
