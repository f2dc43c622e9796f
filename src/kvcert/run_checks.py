"""What `kvcert-run` checks before it runs: the command line's overrides against the run schema and the config
groups (one line naming the unknown key and the nearest valid one, before Hydra starts), and what a debug profile
(`+debug=<profile>`) changes, said in one line when it runs. The config folder is passed in (kvcert.run.config_dir)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf


def debug_changes(cfg: DictConfig, profile: str, conf: Path) -> list[str]:
    """What a debug profile (conf/debug/<profile>.yaml) sets, key by key, as this run has it (a later override
    wins), each key the task does not read marked so: e.g. "task.n_examples=2", "decode.max_new_tokens=10"."""
    raw = yaml.safe_load((conf / "debug" / f"{profile}.yaml").read_text()) or {}
    out = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{path}.")
                continue
            now = OmegaConf.select(cfg, path)
            now = OmegaConf.to_container(now) if OmegaConf.is_config(now) else now
            shown = f"{len(now)} entries" if path == "policy.grid" else json.dumps(now)
            note = ""
            if path in ("task.tasks", "task.context_tokens") and cfg.task.dataset:
                note = f" (unused by task.dataset={cfg.task.dataset})"
            elif path == "budgets.fractions" and cfg.budget is not None:
                note = f" (unused: budget={cfg.budget:g} is set)"
            out.append(f"{path}={shown}{note}")

    walk(raw, "")
    return out


def announce_debug(cfg: DictConfig, conf: Path, say: Callable[[str], None]) -> None:
    """With +debug=<profile>: one line (`say`) saying what the profile changes, before anything runs."""
    from hydra.core.hydra_config import HydraConfig

    try:
        profile = HydraConfig.get().runtime.choices.get("debug")
    except ValueError:  # not under Hydra (a test composing by hand)
        return
    if profile:
        say(f"debug profile {profile} sets: {'; '.join(debug_changes(cfg, profile, conf))}")


def _schema_keys() -> tuple[set[str], set[str]]:
    """(every dotted key of the run schema, the keys below which anything goes: free-form dicts and lists)."""
    from kvcert.config import RunConfig

    keys, open_keys = set(), {"claim", "hydra"}

    def walk(node, prefix: str) -> None:
        for key in node:
            path = f"{prefix}{key}"
            keys.add(path)
            child = node._get_node(key)
            if OmegaConf.is_dict(child) and not child._is_missing() and child._metadata.object_type is not dict:
                walk(child, f"{path}.")
            elif OmegaConf.is_dict(child) or OmegaConf.is_list(child):
                open_keys.add(path)

    walk(OmegaConf.structured(RunConfig), "")
    return keys, open_keys


def _option_names(conf: Path, group: str) -> list[str]:
    folder = conf / group
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))


def check_overrides(args: list[str], conf: Path) -> str | None:
    """The one-line problem with the command line's overrides, or None: an unknown key (`budgett=0.25`, which Hydra
    would answer with "To append to your config use +budgett=0.25", keeping the typo), with the nearest valid key, or
    an unknown option of a config group (`model=smollm3`), with the options. Hydra checks everything else."""
    import difflib

    if any(a.startswith(("hydra.searchpath", "--config-dir", "-cd", "--config-path", "-cp")) for a in args):
        return None  # a user's own config folder: its groups and keys are Hydra's to check
    keys, open_keys = _schema_keys()
    groups = {p.name for p in conf.iterdir() if p.is_dir() and p.name != "hydra"}  # launchers: plugins
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        plus = key.startswith("+")
        key = key.lstrip("+~")
        if key.startswith(("hydra.", "hydra/")):
            continue
        if key in groups:
            options = _option_names(conf, key)
            for choice in value.split(","):
                if "(" in choice or "$" in choice or choice in options or choice in ("null", ""):
                    continue
                near = difflib.get_close_matches(choice, options, n=1, cutoff=0.5)
                mean = f"did you mean {key}={near[0]}? " if near else ""
                return f"{key}={choice}: no such {key} config; {mean}the {key} configs are {', '.join(options)}"
            continue
        base = key.split("[", 1)[0]
        if plus or base in keys or any(base == k or base.startswith(f"{k}.") for k in open_keys):
            continue
        near = difflib.get_close_matches(base, sorted(keys | groups), n=1, cutoff=0.5)
        mean = f"did you mean {near[0]}? " if near else ""
        return f"unknown config key '{base}' in {arg}: {mean}(`python -m kvcert.run --cfg job` lists every key)"
    return None
