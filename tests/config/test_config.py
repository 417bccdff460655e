"""The configuration tree: sources and their order, provenance, and bad input rejected by name."""

import json

import pytest

from torchbay import Accelerator, ConfigError, IncompatibleSetupError
from torchbay.config.model import RESOLVED_ENV
from torchbay.registry.resolve import resolve_config


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults():
    resolved = resolve_config(environ={})
    assert resolved.config.device == "auto" and resolved.config.mixed_precision == "no"
    assert resolved.config.gradient_accumulation_steps == 1
    assert resolved.source_of("mixed_precision") == "default"


def test_defaults_without_input_equal_the_validated_defaults():
    """With no input the tree is built without its validator; it must be what validating no input gives, for every
    section of the installed plugins, and it still validates what is set on it afterwards."""
    from torchbay.registry.resolve import config_model

    resolved = resolve_config(environ={})
    assert resolved.config == config_model().model_validate({})
    assert resolved.config.model_dump() == config_model().model_validate({}).model_dump()
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        resolved.config.gradient_accumulation_steps = 0


def test_precedence_and_provenance(tmp_path):
    path = write(tmp_path, "mixed_precision: fp16\ngradient_accumulation_steps: 2\nseed: 1\n"
                           "dataloader:\n  even_batches: false\n")
    env = {"TORCHBAY_GRADIENT_ACCUMULATION_STEPS": "3", "TORCHBAY_SEED": "2",
           "TORCHBAY_DATALOADER__SPLIT_BATCHES": "true"}
    resolved = resolve_config(file=path, environ=env, cli={"seed": 3, "project.total_limit": 4},
                              args={"mixed_precision": "bf16"})
    c = resolved.config
    assert (c.mixed_precision, c.gradient_accumulation_steps, c.seed) == ("bf16", 3, 3)
    assert c.dataloader.even_batches is False and c.dataloader.split_batches is True
    assert c.project.total_limit == 4
    assert resolved.source_of("mixed_precision") == "args"
    assert resolved.source_of("gradient_accumulation_steps") == "env"
    assert resolved.source_of("seed") == "cli"
    assert resolved.source_of("dataloader.even_batches") == "file"
    assert resolved.source_of("dataloader.split_batches") == "env"
    assert resolved.source_of("project.iteration") == "default"


def test_config_file_from_env(tmp_path):
    path = write(tmp_path, "seed: 7\n")
    assert resolve_config(environ={"TORCHBAY_CONFIG_FILE": path}).config.seed == 7


def test_workers_take_the_launchers_config_as_one_value(tmp_path):
    launched = resolve_config(environ={}, cli={"mixed_precision": "bf16", "seed": 5})
    env = {RESOLVED_ENV: launched.to_json(), "TORCHBAY_SEED": "99"}  # env is not re-read in workers
    worker = resolve_config(environ=env, args={"gradient_accumulation_steps": 2})
    assert ((worker.config.mixed_precision, worker.config.seed, worker.config.gradient_accumulation_steps)
            == ("bf16", 5, 2))
    assert worker.source_of("seed") == "cli" and worker.source_of("gradient_accumulation_steps") == "args"
    json.loads(worker.to_json())


def test_accelerator_arguments_win(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHBAY_MIXED_PRECISION", "fp16")
    acc = Accelerator(mixed_precision="bf16")
    assert acc.mixed_precision == "bf16" and acc.precision.name == "bf16"
    acc.end_training()


BAD_CONFIGS = [
    ("mixed_precison: bf16\n", ["mixed_precison", "did you mean 'mixed_precision'"]),
    ("mixed_precision: fp12\n", ["mixed_precision", "fp12"]),
    ("gradient_accumulation_steps: 0\n", ["gradient_accumulation_steps", "greater than or equal to 1"]),
    ("gradient_accumulation_steps: many\n", ["gradient_accumulation_steps", "many"]),
    ("dataloader:\n  even_batch: false\n", ["dataloader.even_batch", "did you mean 'dataloader.even_batches'"]),
    ("dataloader:\n  split_batches: sometimes\n", ["dataloader.split_batches", "sometimes"]),
    ("split_batches: true\n", ["split_batches", "dataloader.split_batches"]),
    ("num_processes: 8\n", ["num_processes", "launch.num_processes"]),
    ("project:\n  total_limit: 0\n", ["project.total_limit"]),
    ("launch:\n  main_process_port: 70000\n", ["launch.main_process_port"]),
    ("checkpoint:\n  max_shard_size: lots\n", ["checkpoint.max_shard_size", "lots"]),
    ("fp8:\n  recipe: magic\n", ["fp8.recipe", "magic"]),
    ("fp8:\n  amax_history_len: -1\n", ["fp8.amax_history_len"]),
    ("megatron:\n  tp: 2\n", ["megatron", "no plugin torchbay publishes provides config section 'megatron'"]),
    ("seed: [1, 2]\n", ["seed"]),
    ("plugins:\n  required: name\n", ["plugins.required"]),
]


@pytest.mark.parametrize("text,expected", BAD_CONFIGS, ids=[t.split(":")[0] for t, _ in BAD_CONFIGS])
def test_malformed_config_is_rejected_naming_the_field(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        resolve_config(file=path, environ={})
    message = str(info.value)
    for fragment in expected:
        assert fragment in message
    assert "the config file" in message


def test_all_problems_are_reported_at_once(tmp_path):
    path = write(tmp_path, "mixed_precison: bf16\ngradient_accumulation_steps: 0\ndataloader:\n  even_batch: 1\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(file=path, environ={})
    assert len(info.value.problems) == 3


def test_unknown_env_variable_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown key 'mixed_precison'.*environment"):
        resolve_config(environ={"TORCHBAY_MIXED_PRECISON": "bf16"})


@pytest.mark.parametrize("text", ["[1, 2]\n", "a: [unclosed\n"])
def test_file_that_is_not_a_mapping(tmp_path, text):
    with pytest.raises(ConfigError, match="cfg.yaml"):
        resolve_config(file=write(tmp_path, text), environ={})


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(file="/nonexistent/torchbay.yaml", environ={})


def test_unknown_names_fail_before_any_process_group_with_every_problem():
    with pytest.raises(IncompatibleSetupError) as info:
        Accelerator(device="nosuchdevice", strategy="nosuchstrategy", mixed_precision="fp8",
                    config={"fp8": {"backend": "nosuchengine"}, "checkpoint": {"io": "tape"}})
    message = str(info.value)
    assert "no plugin torchbay publishes provides device 'nosuchdevice'" in message  # never pip install <typo>
    assert "no plugin torchbay publishes provides strategy 'nosuchstrategy'" in message
    assert "no plugin torchbay publishes provides fp8 engine 'nosuchengine'" in message
    assert "pip install torchbay-nosuch" not in message and "pip install torchbay-fp8-nosuch" not in message
    assert "checkpoint io 'tape'" in message
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_single_strategy_refuses_several_processes(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(IncompatibleSetupError, match="strategy 'single' runs one process"):
        Accelerator(strategy="single")


def test_process_group_timeout_has_a_default_and_can_be_set(tmp_path):
    assert resolve_config(environ={}).config.process_group_timeout_s == 600
    assert resolve_config(file=write(tmp_path, "process_group_timeout_s: 30\n"), environ={}).config \
        .process_group_timeout_s == 30
    assert resolve_config(environ={"TORCHBAY_PROCESS_GROUP_TIMEOUT_S": "null"}).config.process_group_timeout_s is None


def test_duplicate_yaml_keys_are_refused_with_both_lines(tmp_path):
    with pytest.raises(ConfigError, match=r"duplicate key 'backend' on lines 2 and 4"):
        resolve_config(file=write(tmp_path, "fp8:\n  backend: te\n  margin: 1\n  backend: torchao\n"), environ={})
    with pytest.raises(ConfigError, match=r"duplicate key 'seed' on lines 1 and 2"):  # even with one value
        resolve_config(file=write(tmp_path, "seed: 1\nseed: 1\n"), environ={})


def test_an_accelerate_file_may_repeat_a_key_with_the_same_value_only(tmp_path):
    """Accelerate reads its files with yaml.safe_load (the last repeat wins); its own test config repeats
    ``debug: false``. A repeat with the same value means one thing; another value stays an error."""
    from torchbay.compat.accelerate_config_file import load_config_from_file

    same = tmp_path / "same.yaml"
    same.write_text("debug: false\nfsdp_config: {a: 1}\ndebug: false\nfsdp_config: {a: 1}\n")
    assert load_config_from_file(str(same)).to_dict() == {"debug": False, "fsdp_config": {"a": 1}}
    other = tmp_path / "other.yaml"
    other.write_text("debug: false\ndebug: true\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'debug' on lines 1 and 2"):
        load_config_from_file(str(other))
