"""The documentation stays short, points at files that exist, and speaks to users.

- README.md is under 300 lines; every page under docs/ is linked from it.
- Every repository path named in README.md or docs/*.md exists: paths in inline code spans (relative to the
  repository root) and markdown link targets (relative to the page, as GitHub resolves them). Fenced code blocks are
  examples, not references, and are skipped; so are URLs, globs, <placeholders>, paths outside the repository and
  outputs that only a local run creates (results/runs/, a study's regenerated/ and regeneration/ folders, ...).
- No internal process vocabulary ("stop 16", "issue #12", "previous stop", "SPEC") reaches a reader.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 300

EXTENSIONS = (
    ".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".csv", ".parquet", ".png", ".html", ".log", ".toml", ".lock",
    ".txt", ".cpp", ".cfg", ".ini", ".sh",
)  # fmt: skip
# written by a local run, never committed: named in the docs as where output lands
GENERATED = re.compile(
    r"^(results/runs(/|$)|results/[^/]+/regenerated(/|$)|results/[^/]+/regeneration(/|$)|results/smoke(/|$)"
    r"|results/[^/]+/smoke(/|$)|outputs(/|$)|multirun(/|$)|\.venv(/|$))"
)
GENERATED_NAMES = {"reproduce.log", "COMPLETE", "regeneration.md", "regeneration.json"}
# bare names of files outside the repository: a model folder's config, the user's own data
NOT_REPOSITORY_FILES = {"config.json", "my.jsonl"}
PROCESS_WORDS = [
    re.compile(r"\bstop \d+", re.I),
    re.compile(r"\bissue #\d+", re.I),
    re.compile(r"\bprevious stop\b", re.I),
    re.compile(r"\bSPEC\b"),
]
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PATH_CHARS = re.compile(r"^[A-Za-z0-9_.\-/{},]+$")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _without_fences(text: str) -> str:
    return FENCE.sub("", text)


def _expand_braces(token: str) -> list[str]:
    """`results/study{1,2}/scorecard.{md,json}` -> the four paths it names (shell brace expansion)."""
    parts = re.split(r"\{([^{}]*)\}", token)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _root_entries() -> set[str]:
    return {p.name for p in ROOT.iterdir()} | {"src", "conf", "docs", "results", "tests", "preregistration"}


@functools.cache
def _basenames() -> frozenset[str]:
    """Every file and folder name in the repository (build outputs, caches and run folders pruned)."""
    prune = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}
    local_runs = {ROOT / "results" / "runs", ROOT / "outputs", ROOT / "multirun"}
    names = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in prune and Path(top, d) not in local_runs]
        names.update(dirs, files)
    return frozenset(names)


def path_candidates(token: str, roots: set[str]) -> list[str]:
    """The repository paths one word of a code span names ([] when it names none): a word made of path characters
    that either has a `/` and starts at a top-level entry of the repository, or ends with a known file extension."""
    token = token.lstrip("('\"[").rstrip("'\")];:,.")
    if not token or token.startswith(("/", "-", "./", "../")) or not PATH_CHARS.match(token):
        return []  # absolute or relative-outside paths, options; prose, math, URLs, globs, overrides, placeholders
    out = []
    for path in _expand_braces(token):
        at_root = "/" in path and path.split("/", 1)[0] in roots
        if at_root or ("/" not in path and path.endswith(EXTENSIONS)):
            out.append(path)
    return out


def _span_words(span: str) -> list[str]:
    """The words of a code span; a word holding a <placeholder> names no fixed file and is dropped."""
    return [word for word in span.split() if not re.search(r"<[^<>]*>", word)]


def referenced_paths(page: Path, text: str | None = None) -> list[tuple[str, str, Path]]:
    """(kind, as written, resolved path) for every repository path the page names; kind is "span" (relative to the
    repository root) or "link" (relative to the page)."""
    text = _without_fences(page.read_text() if text is None else text)
    roots = _root_entries()
    found = []
    for match in CODE_SPAN.finditer(text):
        for word in _span_words(match.group(2)):
            found += [("span", path, ROOT / path) for path in path_candidates(word, roots)]
    for match in LINK.finditer(text):
        target = match.group(1).split("#", 1)[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            found.append(("link", target, (page.parent / target).resolve()))
    return found


def _is_generated(resolved: Path) -> bool:
    return resolved.is_relative_to(ROOT) and bool(GENERATED.match(resolved.relative_to(ROOT).as_posix()))


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [_rel(p) for p in PAGES[1:] if f"]({_rel(p)})" not in readme]
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_paths_exist(page: Path):
    names = _basenames()
    missing = []
    for kind, written, resolved in referenced_paths(page):
        if resolved.exists() or _is_generated(resolved):
            continue
        if kind == "span" and "/" not in written and written in names | GENERATED_NAMES | NOT_REPOSITORY_FILES:
            continue  # a bare file name (`examples.parquet`, `PLAN.md`) of a file somewhere in the repository
        missing.append(written)
    assert not missing, f"{_rel(page)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_process_words(page: Path):
    text = page.read_text()
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        hits += [f"line {number}: {m.group(0)!r}" for pattern in PROCESS_WORDS for m in pattern.finditer(line)]
    assert not hits, f"{_rel(page)} uses process words a reader cannot resolve: {hits}"


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("src/kvcert/run.py", ["src/kvcert/run.py"]),
        ("results/study{1,2}/scorecard.md", ["results/study1/scorecard.md", "results/study2/scorecard.md"]),
        ("conf/task/jsonl.yaml", ["conf/task/jsonl.yaml"]),
        ("src/kvcert/core/", ["src/kvcert/core/"]),
        ("README.md", ["README.md"]),
        ("examples.parquet", ["examples.parquet"]),
        ("https://ai.google.dev/gemma/terms", []),
        ("results/claim_*.json", []),
        ("Qwen/Qwen2.5-0.5B-Instruct", []),
        ("model.name=Qwen/Qwen2.5-0.5B-Instruct", []),
        ("task.path=my.jsonl", []),
        ("~/.cache/kvcert/models", []),
        ("/data/my_qa.jsonl", []),
        ("1/||k||", []),
        ("kvcert.core.simulate", []),
        (".ci/run", [".ci/run"]),
        ("../kvcert-study1", []),
        ("(conf/config.yaml),", ["conf/config.yaml"]),
        ("results/<study>/published/", []),
    ],
)
def test_path_extractor(word: str, expected: list[str]):
    assert path_candidates(word, _root_entries()) == expected


def test_extractor_reads_spans_and_links_but_not_fences():
    page = ROOT / "docs" / "example.md"
    text = (
        "See `results/scorecard.md` and [the API](api.md#top), `results/<study>/published/`,\n"
        "```bash\ncat results/nothing/here.md\n```\n"
        "`make bench BENCH_ARGS=--quick` writes `results/bench/quick/`; [web](https://example.org/a.md)."
    )
    found = referenced_paths(page, text)
    assert [(kind, written) for kind, written, _ in found] == [
        ("span", "results/scorecard.md"),
        ("span", "results/bench/quick/"),
        ("link", "api.md"),
    ]
    assert found[-1][2] == ROOT / "docs" / "api.md"
    assert _is_generated(ROOT / "results" / "runs" / "x") and _is_generated(ROOT / "results/study1/regenerated/a")
    assert not _is_generated(ROOT / "results" / "scorecard.md")


COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
STUDY_COUNT_PHRASE = re.compile(r"\b(one|two|three|four|five|six)[- ]stud(?:y|ies)\b", re.I)


def _scorecard_studies() -> list[str]:
    import json

    return list(json.loads((ROOT / "results" / "scorecard.json").read_text())["studies"])


def test_readme_counts_the_studies_the_scorecard_holds():
    """The README's words for how many studies there are match results/scorecard.json (study 3's two models are one
    study with two columns): a README that still said "two-study" beside a four-column scorecard misled readers."""
    numbers = {re.match(r"study(\d+)", s).group(1) for s in _scorecard_studies()}
    word = COUNT_WORDS[len(numbers)]
    text = _without_fences((ROOT / "README.md").read_text())
    said = {m.group(1).lower() for m in STUDY_COUNT_PHRASE.finditer(text)}
    said |= {m.group(1).lower() for m in re.finditer(r"the (one|two|three|four|five|six) studies", text, re.I)}
    assert said == {word}, f"README.md speaks of {sorted(said)} studies; results/scorecard.json holds {word}"


def test_readme_scorecard_table_is_the_committed_one():
    """The results table in the README is the first table of results/scorecard.md (one row per claim: the paper's
    verdict and ours), copied row for row; the per-study table stays in the scorecard."""

    def claim_rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if re.match(r"\| (C\d|T\d): ", line)]

    scorecard = (ROOT / "results" / "scorecard.md").read_text()
    first = scorecard[scorecard.index("## What holds") : scorecard.index("## Every study's verdict")]
    readme = claim_rows((ROOT / "README.md").read_text())
    committed = claim_rows(first)
    assert committed and readme == committed, "copy the first table's claim rows of results/scorecard.md into README"
    lines = (ROOT / "README.md").read_text().splitlines()
    header = next(line for line in lines if re.match(r"\| claim +\| paper +\| ours", line))  # padded cells
    assert header == next(line for line in first.splitlines() if line.startswith("| claim"))
    assert not any(re.match(r"\| claim +\| study", line) for line in lines)  # not the 11-column table


# ------------------------------------------------------------------- study 5's verdicts as the docs state them
STUDY5_MODELS = {"smollm2": "SmolLM2", "gemma3": "Gemma"}  # the docs' names ("Gemma" also matches "Gemma 3")
VERDICT_ON = re.compile(
    r"\b(supported|refuted|inconclusive) on (SmolLM2|Gemma(?: 3)?|both models)"
    r"(?: \(([+-]?\d+\.\d+) \[([+-]?\d+\.\d+), ([+-]?\d+\.\d+)\])?"
)
CLAIM_LABEL = re.compile(r"\b(P[1-5]) \(")


def _study5_claims() -> dict:
    import json

    return json.loads((ROOT / "results" / "study5" / "claims.json").read_text())


def _study5_passages() -> dict[str, list[str]]:
    """Per page, the passages that state study 5's verdicts: docs/studies.md's Study 5 result bullet, and every
    paragraph of docs/generate.md that names study 5 (the P labels there are study 5's)."""
    studies = _without_fences((ROOT / "docs" / "studies.md").read_text())
    bullet = re.search(r"^- \*\*Study 5\*\* \(`results/study5/report\.md`.*?(?=\n\n|\n- |\Z)", studies, re.M | re.S)
    generate = _without_fences((ROOT / "docs" / "generate.md").read_text())
    paragraphs = [p for p in re.split(r"\n\s*\n", generate) if re.search(r"\bstudy 5\b", p, re.I)]
    return {"docs/studies.md": [bullet.group(0)] if bullet else [], "docs/generate.md": paragraphs}


def _stated_verdicts(passage: str) -> list[tuple[str, str, str, tuple[float, ...] | None]]:
    """(claim, model tag, verdict, (estimate, lo, hi) or None) for each "<verdict> on <model> (<est> [<lo>, <hi>])"
    after a claim label "P<k> (" in the same sentence."""
    out = []
    for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z])", " ".join(passage.split())):
        labels = list(CLAIM_LABEL.finditer(sentence))
        for i, label in enumerate(labels):
            chunk = sentence[label.start() : labels[i + 1].start() if i + 1 < len(labels) else len(sentence)]
            for m in VERDICT_ON.finditer(chunk):
                tags = list(STUDY5_MODELS) if m.group(2) == "both models" else [
                    t for t, name in STUDY5_MODELS.items() if m.group(2).startswith(name)]  # fmt: skip
                numbers = tuple(float(x) for x in m.groups()[2:]) if m.group(3) else None
                out += [(label.group(1), tag, m.group(1), numbers) for tag in tags]
    return out


def _agrees(shown: str | float, value: float) -> bool:
    text = f"{shown}"
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(shown) - value) <= 0.5 * 10**-decimals + 1e-9


@pytest.mark.parametrize("page", ["docs/studies.md", "docs/generate.md"])
def test_study5_verdicts_in_the_docs_are_those_of_claims_json(page):
    """Every "P<k> (...) <verdict> on <model>" the docs state about study 5 is results/study5/claims.json's verdict,
    and a quoted estimate [interval] is its value at the precision shown. docs/generate.md once said study 5 "found
    no draw-based signal that beats confidence" inside one kind of prompt while SmolLM2's P2 and P4 were supported."""
    claims = _study5_claims()
    stated = [s for passage in _study5_passages()[page] for s in _stated_verdicts(passage)]
    named = {(cid, tag) for cid, tag, _, _ in stated}
    need = {(c, t) for c in ("P1", "P2", "P4") for t in STUDY5_MODELS}
    if page == "docs/studies.md":
        need |= {(c, t) for c in ("P3", "P5") for t in STUDY5_MODELS}
    else:
        need |= {("P5", t) for t in STUDY5_MODELS}
    assert need <= named, f"{page} does not state study 5's {sorted(need - named)} per model"
    for cid, tag, said, numbers in stated:
        published = claims[tag]["claims"][cid]
        assert said == published["verdict"], (
            f"{page}: {cid} on {tag} is {said}, claims.json says {published['verdict']}"
        )
        if numbers:
            for shown, key in zip(numbers, ("estimate", "lo", "hi")):
                assert _agrees(shown, published[key]), f"{page}: {cid} on {tag} {key} {shown} vs {published[key]}"


def test_generate_md_does_not_say_study5_found_nothing_or_is_undecided():
    claims = _study5_claims()
    text = " ".join((ROOT / "docs" / "generate.md").read_text().split())
    within = [claims[t]["claims"][c]["verdict"] for t in STUDY5_MODELS for c in ("P1", "P2", "P4")]
    if "supported" in within:
        assert "no draw-based signal that beats" not in text
    if all("P5" in claims[t]["claims"] for t in STUDY5_MODELS):
        assert "until it is decided" not in text


def test_studies_md_counts_the_studies_that_have_a_lock():
    """docs/studies.md's opening says how many studies there are: one per lock (preregistration/LOCK.json and
    preregistration/study*/LOCK.json), none of them "running" (it opened with "Three studies ... A fourth, locked and
    running" when five were decided)."""
    n = len([ROOT / "preregistration" / "LOCK.json", *(ROOT / "preregistration").glob("study*/LOCK.json")])
    opening = " ".join(_without_fences((ROOT / "docs" / "studies.md").read_text()).split("\n\n")[1].split())
    said = {m.group(1).lower() for m in re.finditer(r"\b(one|two|three|four|five|six|seven) studies\b", opening, re.I)}
    assert said == {COUNT_WORDS[n]}, f"docs/studies.md opens with {sorted(said)} studies; {n} are locked"
    assert not re.search(r"\b(running|a fourth|a fifth)\b", opening, re.I)
