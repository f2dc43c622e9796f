"""The Hydra schema: every config composes and validates, bad values fail in one line naming the key, folder
names are stable."""

import pytest

from conftest import CONF, compose
from kvcert.config import ConfigError, policies, result_name, validate
from kvcert.run import decode_options


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "task", "policy", "budgets"])
def test_every_group_option_composes_and_validates(group, tmp_path):
    for option in _group_options(group):
        overrides = [f"{group}={option}"]
        if group == "model" and option == "hf":
            overrides.append("model.name=some/model")
        if group == "task" and option == "jsonl":
            data = tmp_path / "qa.jsonl"
            data.write_text('{"context": "c", "question": "q?", "answers": ["a"]}\n')
            overrides.append(f"task.path={data}")
        cfg = compose(overrides)
        validate(cfg)
        assert policies(cfg)[0].is_full


def test_debug_claim_and_launcher_configs_compose():
    validate(compose(["+debug=smoke"]))
    for claim in _group_options("claim"):
        validate(compose([f"+claim={claim}"]))
    for launcher in ["basic", "local"]:
        compose([f"hydra/launcher={launcher}"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy.grid=[{scorer: h2o, designs: [topk]}]"], "policy.grid[0].scorer='h2o' is not allowed"),
        (["policy.grid=[{scorer: streaming, designs: [bogus]}]"], "policy.grid[0].designs='bogus'"),
        (["budgets.fractions=[0.5,1.5]"], "budgets.fractions contains 1.5"),
        (["budget=1.5"], "budget=1.5; a budget is the kept fraction"),
        (["budgets.fractions=[0]"], "budgets.fractions contains 0"),
        (["policy.tail_fraction=1.0"], "policy.tail_fraction=1.0: tail_fraction must be in [0, 1)"),
        (["task.tasks=[needle]"], "task.tasks='needle' is not allowed"),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_folder_names_ignore_speed_switches_and_unset_optional_keys():
    """Study 1's confirmatory folder keeps its name: decode.backend only changes speed, and the optional policy keys
    (compress_after, protect_question) enter the hash only when set."""
    cfg = compose(["+claim=c1_coverage"])
    name = "smollm2-135m-instruct__5tasks__1000-2000__claims__b0.25-0.5-0.75__s0__163b0397"
    assert result_name(cfg) == name
    assert result_name(compose(["+claim=c1_coverage", "decode.backend=torch"])) == name
    assert decode_options(compose(["decode.backend=compiled"])).backend == "compiled"
    kv = compose(["policy.grid=[{scorer: streaming, designs: [topk], compress_after: context}]"])
    plain = compose(["policy.grid=[{scorer: streaming, designs: [topk]}]"])
    assert result_name(kv) != result_name(plain)
    assert policies(kv)[1].compress_after == "context" and policies(plain)[1].compress_after == "prompt"


def test_a_saved_config_of_the_two_path_engine_still_matches_its_folder():
    """Folders whose config.yaml still holds the removed speed switches keep matching (record_content drops them)."""
    from omegaconf import OmegaConf

    from kvcert.config import REMOVED_SPEED_KEYS, record_content

    content = OmegaConf.to_container(compose(["+claim=c1_coverage"]))
    old = {**content, "decode": {**content["decode"], **dict.fromkeys(REMOVED_SPEED_KEYS, True), "packed_weights": 0}}
    assert record_content(old) == record_content(content)


def test_bad_backend_or_compiled_on_cuda_is_one_line():
    with pytest.raises(ConfigError, match="decode.backend") as err:
        validate(compose(["decode.backend=fused"]))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="CPU kernel and device=cuda") as err:
        validate(compose(["decode.backend=compiled", "device=cuda"]))
    assert "\n" not in str(err.value)


def test_bad_protocol_combination_is_one_line():
    with pytest.raises(ConfigError) as err:
        validate(compose(["policy.grid=[{scorer: window_context, designs: [topk], compress_after: prompt}]"]))
    assert "policy.grid[0]" in str(err.value) and "compress_after=context" in str(err.value)
    assert "\n" not in str(err.value)
