"""``torchbay config``: questionnaire, --default, show --sources (precedence and provenance),
schema, validate, import-accelerate; and every malformed flag or file gives one clear message."""

import io
import json
from pathlib import Path

import pytest
import yaml

from torchbay.cli.main import main
from torchbay.registry.manager import PluginManager, hookimpl, reset_plugin_manager

TESTS = Path(__file__).resolve().parents[1]
FIXTURES = TESTS / "fixtures" / "accelerate"
SCRIPT = str(TESTS / "scripts" / "cli_ranks.py")


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# --- precedence and provenance -----------------------------------------------------------------


def test_show_sources_precedence(capsys, tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mixed_precision: fp16\nseed: 1\ngradient_accumulation_steps: 2\n"
                   "dataloader:\n  even_batches: false\n")
    monkeypatch.setenv("TORCHBAY_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("TORCHBAY_SEED", "5")
    code, out, err = run(capsys, "config", "show", "--sources", "--config-file", str(cfg), "--seed", "7",
                         "--dataloader-split-batches", "--set", "project.total_limit=3")
    assert code == 0, err
    lines = {line.split(" = ")[0].strip(): " ".join(line.split()) for line in out.splitlines()}
    assert lines["seed"].endswith("= 7 # command line --seed")
    assert lines["mixed_precision"].endswith('= "bf16" # environment TORCHBAY_MIXED_PRECISION')
    assert lines["gradient_accumulation_steps"].endswith(f"= 2 # config file {cfg}")
    assert lines["dataloader.even_batches"].endswith(f"= false # config file {cfg}")
    assert lines["dataloader.split_batches"].endswith("= true # command line --dataloader-split-batches")
    assert lines["project.total_limit"].endswith("= 3 # command line --set project.total_limit=...")
    assert lines["device"].endswith('= "auto" # default')


def test_show_yaml_and_json(capsys, tmp_path):
    code, out, _ = run(capsys, "config", "show", "--mixed-precision", "bf16", "--num-processes", "4")
    assert code == 0
    tree = yaml.safe_load(out)
    assert tree["mixed_precision"] == "bf16" and tree["launch"]["num_processes"] == 4
    code, out, _ = run(capsys, "config", "show", "--format", "json", "--sources", "--fp8-include", "a,b")
    payload = json.loads(out)
    assert payload["config"]["fp8"]["include"] == ["a", "b"] and payload["sources"]["fp8.include"] == "cli"


def test_schema_has_core_and_plugin_sections(capsys):
    class Plugin:
        @hookimpl
        def torchbay_config_sections(self):
            from torchbay.config.model import Section

            class Extra(Section):
                level: int = 1

            return {"extra_cli_test": Extra}

    pm = PluginManager()
    pm.register_plugin(Plugin(), "extra-cli-test")
    reset_plugin_manager(pm)
    code, out, _ = run(capsys, "config", "schema")
    schema = json.loads(out)
    assert code == 0
    assert {"device", "strategy", "mixed_precision", "launch", "fp8", "extra_cli_test"} <= set(schema["properties"])


def test_plugin_flags_and_the_selected_strategys_launch_env(capsys):
    from torchbay.builtin.strategies import DDPStrategy
    from torchbay.config.model import Section

    class Level(Section):
        level: int = 1

    class CliTestStrategy(DDPStrategy):
        name = "clitest"

        @classmethod
        def launch_env(cls, local_world_size, config, device_cls):
            return {"CLITEST_VISIBLE": ",".join(str(i) for i in range(local_world_size)),
                    "CLITEST_LEVEL": config.clitest.level, "CLITEST_DEVICE": device_cls.name}

    class Plugin:
        @hookimpl
        def torchbay_register_strategies(self):
            return [CliTestStrategy]

        @hookimpl
        def torchbay_config_sections(self):
            return {"clitest": Level}

        @hookimpl
        def torchbay_add_cli_options(self, parser, command):
            parser.add_argument("--clitest-level", dest="clitest.level", type=int, default=1)


    pm = PluginManager()
    pm.register_plugin(Plugin(), "clitest")
    reset_plugin_manager(pm)
    code, out, err = run(capsys, "launch", "--dry-run", "--nproc-per-node", "3", "--clitest-level", "4", SCRIPT)
    assert code == 0, err
    assert "CLITEST_VISIBLE" not in out  # its strategy is not selected: it adds nothing
    code, out, err = run(capsys, "launch", "--dry-run", "--nproc-per-node", "3", "--clitest-level", "4",
                         "--strategy", "clitest", SCRIPT)
    assert code == 0, err
    assert "CLITEST_VISIBLE=0,1,2" in out and "CLITEST_LEVEL=4" in out and "CLITEST_DEVICE=cpu" in out
    code, out, _ = run(capsys, "config", "show", "--sources", "--clitest-level", "5")
    assert "clitest.level = 5 # command line --clitest-level" in " ".join(out.split())
    # a plugin flag left out does not count as a command-line value
    code, out, _ = run(capsys, "config", "show", "--sources")
    assert "clitest.level = 1 # default" in " ".join(out.split())


# --- writing configs ------------------------------------------------------------------------


def test_default_config(capsys, tmp_path):
    out_file = tmp_path / "t.yaml"
    code, _, err = run(capsys, "config", "--default", "-o", str(out_file))
    assert code == 0, err
    tree = yaml.safe_load(out_file.read_text())
    assert tree["device"] and tree["strategy"] == "auto" and tree["mixed_precision"] in ("no", "bf16")
    code, _, err = run(capsys, "config", "--default", "-o", str(out_file))
    assert code == 2 and "--force" in err
    code, out, err = run(capsys, "config", "validate", str(out_file))
    assert code == 0 and "valid" in out


def test_questionnaire_asks_installed_choices(capsys, tmp_path, monkeypatch):
    from torchbay.registry.manager import get_plugin_manager

    registries = get_plugin_manager().registries()
    answers = {"Which device": "cpu", "How many machines": "2", "Rank of this machine": "1",
               "Address of machine 0": "10.0.0.1", "Port on machine 0": "29501",
               "How many processes on each machine": "3", "Which strategy": "ddp", "Mixed precision": "bf16",
               "Gradient accumulation": "4", "Seed": "42"}
    prompts = []

    def fake_input(prompt):
        prompts.append(prompt)
        return next((answer for start, answer in answers.items() if prompt.startswith(start)), "")

    monkeypatch.setattr("builtins.input", fake_input)
    out_file = tmp_path / "q.yaml"
    code, _, err = run(capsys, "config", "-o", str(out_file))
    assert code == 0, err
    tree = yaml.safe_load(out_file.read_text())
    assert tree["device"] == "cpu" and tree["strategy"] == "ddp" and tree["mixed_precision"] == "bf16"
    assert tree["launch"] == {"num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1",
                              "main_process_port": 29501, "nproc_per_node": 3}
    assert tree["gradient_accumulation_steps"] == 4 and tree["seed"] == 42
    usable = [n for n, cls in registries["devices"].items() if cls.is_available()]
    device_prompts = [p for p in prompts if p.startswith("Which device")]
    if len(usable) > 1:  # choices come from the installed, usable devices
        assert all(n in device_prompts[0] for n in usable)
    else:  # no choice, no question
        assert not device_prompts
    strategy_prompt = next(p for p in prompts if p.startswith("Which strategy"))
    for name, cls in registries["strategies"].items():
        assert (name in strategy_prompt) == cls.multi_process  # only strategies that can run 6 processes


def test_questionnaire_without_a_terminal(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, _, err = run(capsys, "config", "-o", str(tmp_path / "x.yaml"))
    assert code == 2 and "--default" in err and "Traceback" not in err
    assert not (tmp_path / "x.yaml").exists()


# --- malformed input: one clear message, non-zero exit, no traceback ------------------------------

BAD_FILES = {
    "not yaml": ("device: [cpu\n", "is not valid YAML"),
    "a list": ("- device\n- cpu\n", "must hold a mapping"),
    "misspelt key": ("mixed_precison: bf16\n", "did you mean 'mixed_precision'"),
    "renamed key": ("num_processes: 4\n", "it now lives at 'launch.num_processes'"),
    "bad value": ("mixed_precision: fp9\n", "'mixed_precision' = 'fp9' (set in the config file)"),
    "nested bad value": ("launch:\n  main_process_port: 70000\n", "launch.main_process_port"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_malformed_files(capsys, tmp_path, case):
    text, expected = BAD_FILES[case]
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    for argv in (["config", "validate", str(cfg)], ["launch", "--dry-run", "--config-file", str(cfg), SCRIPT]):
        code, out, err = run(capsys, *argv)
        assert code == 2, (case, argv, out, err)
        assert expected in err, (case, err)
        assert "Traceback" not in err + out
        assert err.startswith(f"torchbay {argv[0]}: error:")


BAD_FLAGS = {
    "non-integer": (["--num-processes", "two"], "'launch.num_processes' = 'two' (set in a command-line flag)"),
    "zero processes": (["--num-processes", "0"], "greater than or equal to 1"),
    "bad precision": (["--mixed-precision", "fp9"], "'mixed_precision' = 'fp9'"),
    "does not multiply": (["--num-processes", "6", "--nproc-per-node", "4", "--num-machines", "2"],
                          "--num-processes 6 (the total across machines, from command line --num-processes) is not "
                          "--nproc-per-node 4"),
    "uneven split": (["--num-processes", "3", "--num-machines", "2", "--main-process-ip", "h"],
                     "cannot be split evenly over --num-machines 2"),
    "no address": (["--num-processes", "4", "--num-machines", "2"], "needs the address of machine 0"),
    "rank too high": (["--num-machines", "2", "--machine-rank", "2", "--main-process-ip", "h"],
                      "--machine-rank 2 (from command line --machine-rank) must be below --num-machines 2"),
    "unknown strategy": (["--strategy", "nosuch"], "strategy 'nosuch' is not installed"),
    "unknown device": (["--device", "nosuch"], "device 'nosuch' is not installed"),
    "missing config file": (["--config-file", "/nonexistent/c.yaml"], "does not exist"),
    "bad --set": (["--set", "novalue"], "expected KEY=VALUE"),
    "unknown --set key": (["--set", "dataloader.evn_batches=1"], "did you mean 'dataloader.even_batches'"),
    "single with many": (["--strategy", "single", "--num-processes", "2"], "strategy 'single' runs one process"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_malformed_flags(capsys, case):
    flags, expected = BAD_FLAGS[case]
    code, out, err = run(capsys, "launch", "--dry-run", *flags, SCRIPT)
    assert code == 2, (case, out, err)
    assert expected in err, (case, err)
    assert "Traceback" not in err + out


@pytest.mark.parametrize("argv, expected", [
    (["launch", "--num-procs", "2", SCRIPT], "unrecognized option --num-procs; did you mean --num-processes?"),
    (["launch"], "the following arguments are required: TARGET"),
    (["launch", "missing_script.py"], "script 'missing_script.py' does not exist"),
    (["launch", "--num-processes"], "expected one argument"),
    (["config", "validate"], "the following arguments are required: FILE"),
    (["config", "import-accelerate", "/nonexistent.yaml"], "does not exist"),
])
def test_malformed_command_lines(capsys, argv, expected):
    code, out, err = run(capsys, *argv)
    assert code == 2 and expected in err and "Traceback" not in err


def test_bad_environment_value_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("TORCHBAY_GRADIENT_ACCUMULATION_STEPS", "many")
    code, _, err = run(capsys, "config", "show")
    assert code == 2 and "set in the environment (TORCHBAY_*)" in err and "gradient_accumulation_steps" in err


# --- import-accelerate -----------------------------------------------------------------------


def import_fixture(capsys, tmp_path, name):
    out = tmp_path / f"{name}.torchbay.yaml"
    code, _, err = run(capsys, "config", "import-accelerate", str(FIXTURES / f"{name}.yaml"), "-o", str(out))
    assert code == 0, err
    source = yaml.safe_load((FIXTURES / f"{name}.yaml").read_text())
    for key, value in source.items():  # every key is accounted for: nothing dropped silently
        assert key in err, f"{key} not reported"
        for sub in (value or {}) if isinstance(value, dict) else {}:
            assert f"{key}.{sub}" in err, f"{key}.{sub} not reported"
    return yaml.safe_load(out.read_text()), out.read_text(), err


def test_import_single_cpu(capsys, tmp_path):
    tree, _, err = import_fixture(capsys, tmp_path, "single_cpu")
    assert tree["device"] == "cpu" and tree["mixed_precision"] == "no"
    assert tree["launch"]["num_processes"] == 1 and "strategy" not in tree
    assert "0 not imported" in err


def test_import_multi_gpu(capsys, tmp_path):
    tree, _, err = import_fixture(capsys, tmp_path, "multi_gpu")
    assert (tree["device"], tree["strategy"], tree["mixed_precision"]) == ("cuda", "ddp", "bf16")
    assert tree["launch"]["num_processes"] == 8
    assert "ignored      gpu_ids = 'all'" in err


def test_import_multi_node(capsys, tmp_path):
    tree, text, err = import_fixture(capsys, tmp_path, "multi_node")
    assert tree["launch"] == {"num_processes": 16, "num_machines": 2, "machine_rank": 1,
                              "main_process_ip": "10.0.0.1", "main_process_port": 29555, "rdzv_backend": "static"}
    assert tree["mixed_precision"] == "fp16"
    assert "NOT IMPORTED gpu_ids = '0,1,2,3'" in err and "# NOT IMPORTED gpu_ids" in text


def test_import_fsdp(capsys, tmp_path):
    tree, text, err = import_fixture(capsys, tmp_path, "fsdp")
    assert tree["strategy"] == "fsdp" and tree["mixed_precision"] == "bf16"
    assert tree["fsdp"] == {"activation_checkpointing": False, "wrap_policy": "transformer",
                            "backward_prefetch": "BACKWARD_PRE", "cpu_ram_efficient_loading": True,
                            "cpu_offload": False, "reshard_after_forward": True,
                            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "MistralDecoderLayer"], "version": 2}
    # SHARDED_STATE_DICT is what save_state writes anyway (DCP): no effect, nothing lost
    assert "ignored      fsdp_config.fsdp_state_dict_type = 'SHARDED_STATE_DICT'" in err
    assert "NOT IMPORTED fsdp_config" not in err
    assert "invalid" not in err


def test_import_deepspeed(capsys, tmp_path):
    tree, _, err = import_fixture(capsys, tmp_path, "deepspeed")
    assert tree["strategy"] == "deepspeed" and tree["gradient_accumulation_steps"] == 4
    assert tree["deepspeed"] == {"gradient_clipping": 1.0, "offload_optimizer_device": "cpu",
                                 "offload_param_device": "none", "zero3_init": True,
                                 "zero3_save_16bit_model": True, "zero_stage": 3}
    assert "ignored      deepspeed_config.deepspeed_multinode_launcher = 'standard'" in err
    assert "invalid" not in err


def test_import_fp8(capsys, tmp_path):
    tree, _, err = import_fixture(capsys, tmp_path, "fp8")
    assert tree["mixed_precision"] == "fp8" and tree["device"] == "cuda"
    assert tree["fp8"] == {"amax_compute_algo": "max", "amax_history_len": 1024, "backend": "te",
                           "format": "HYBRID", "engine_options": {"interval": 1,
                                                                  "override_linear_precision": [False, False, False],
                                                                  "use_autocast_during_eval": False},
                           "margin": 0, "recipe": "delayed"}
    assert "invalid" not in err


def test_import_names_every_unmappable_key(capsys, tmp_path):
    code, out, err = run(capsys, "config", "import-accelerate", str(FIXTURES / "unmappable.yaml"), "--strict")
    assert code == 1
    for key in ("compute_environment = 'AMAZON_SAGEMAKER'", "distributed_type = 'MEGATRON_LM'", "ipex_config",
                "megatron_lm_config", "some_future_key = 3"):
        assert f"NOT IMPORTED {key}" in err
    assert yaml.safe_load(out) == {"mixed_precision": "fp16", "launch": {"num_processes": 2}}


def test_import_maps_dynamo_config_to_the_compile_section(capsys, tmp_path):
    f = tmp_path / "a.yaml"
    f.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\ndynamo_config:\n"
                 "  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n  dynamo_use_fullgraph: true\n"
                 "  dynamo_use_dynamic: false\n  dynamo_use_regional_compilation: true\n")
    code, out, err = run(capsys, "config", "import-accelerate", str(f), "--strict")
    assert code == 0, err
    assert yaml.safe_load(out)["compile"] == {"enabled": True, "backend": "inductor", "mode": "max-autotune",
                                              "fullgraph": True, "dynamic": False, "regional": True}
    f.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\ndynamo_config:\n  dynamo_backend: 'NO'\n")
    code, out, err = run(capsys, "config", "import-accelerate", str(f), "--strict")
    assert code == 0 and "compile" not in (yaml.safe_load(out) or {}), (out, err)
    assert "ignored      dynamo_config.dynamo_backend = 'NO'" in err


def test_import_rejects_a_non_accelerate_file(capsys, tmp_path):
    other = tmp_path / "o.yaml"
    other.write_text("device: cpu\n")
    code, _, err = run(capsys, "config", "import-accelerate", str(other))
    assert code == 2 and "does not look like an Accelerate config" in err


def test_import_unquoted_no(capsys, tmp_path):
    f = tmp_path / "a.yaml"
    f.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nmixed_precision: no\nuse_cpu: true\n")
    code, out, err = run(capsys, "config", "import-accelerate", str(f))
    assert code == 0, err
    assert yaml.safe_load(out) == {"device": "cpu", "mixed_precision": "no"}


def test_questionnaire_asks_a_chosen_plugins_own_section(capsys, tmp_path, monkeypatch):
    from typing import Literal

    from torchbay.axes.strategy import Strategy
    from torchbay.config.model import Section

    class ShardyConfig(Section):
        shards: int = 2
        offload: bool = False
        mode: Literal["fast", "small"] = "fast"

    class Shardy(Strategy):
        name = "shardy"

    class Plugin:
        @hookimpl
        def torchbay_register_strategies(self):
            return [Shardy]

        @hookimpl
        def torchbay_config_sections(self):
            return {"shardy": ShardyConfig}

    pm = PluginManager()
    pm.register_plugin(Plugin(), "shardy")
    reset_plugin_manager(pm)
    answers = {"How many processes": "2", "Which strategy": "shardy", "shardy.shards": "4", "shardy.offload": "yes",
               "shardy.mode": "small"}
    prompts = []

    def fake_input(prompt):
        prompts.append(prompt)
        return next((a for start, a in answers.items() if prompt.startswith(start)), "")

    monkeypatch.setattr("builtins.input", fake_input)
    out_file = tmp_path / "s.yaml"
    code, _, err = run(capsys, "config", "-o", str(out_file))
    assert code == 0, err
    tree = yaml.safe_load(out_file.read_text())
    assert tree["strategy"] == "shardy" and tree["shardy"] == {"shards": 4, "offload": True, "mode": "small"}
    assert any("[fast/small]" in p for p in prompts if p.startswith("shardy.mode"))
    # a section of a plugin that was not chosen is not asked about
    assert not [p for p in prompts if p.startswith(("fsdp.", "deepspeed."))]
