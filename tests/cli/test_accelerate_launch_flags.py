"""``accelerate launch``'s whole flag table on ``torchbay launch`` (issue 36): every flag that names a key of
Accelerate's nested configs maps onto the torchbay key the same config file key maps to (one table, read from
resources/accelerate.yaml and each plugin's accelerate.yaml), and ``config show --sources`` names the flag."""

import pytest

from torchbay.cli.main import main
from torchbay.compat.config_import import convert

FSDP = pytest.importorskip("torchbay_fsdp")


def shown(capsys, *flags):
    """``{key: (value, where)}`` from ``torchbay config show --sources FLAGS``."""
    code = main(["config", "show", "--sources", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = {}
    for line in out.splitlines():
        key, _, rest = line.partition(" = ")
        value, _, where = rest.partition("  # ")
        rows[key.strip()] = (value, where)
    return rows


@pytest.fixture(autouse=True)
def _workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./torchbay.yaml found by accident
    for name in ("TORCHBAY_CONFIG_FILE", "TORCHBAY_RESOLVED_CONFIG"):
        monkeypatch.delenv(name, raising=False)


# Each flag, its value, and the Accelerate config file entry that means the same
CASES = [
    (["--fsdp_offload_params", "true"], {"fsdp_config": {"fsdp_offload_params": True}}, "fsdp.cpu_offload"),
    (["--fsdp_sharding_strategy", "SHARD_GRAD_OP"], {"fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}},
     "fsdp.reshard_after_forward"),
    (["--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP"], {"fsdp_config": {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}},
     "fsdp.wrap_policy"),
    (["--parallelism_config_tp_size", "2"], {"parallelism_config": {"parallelism_config_tp_size": 2}},
     "parallelism.tp_size"),
    (["--parallelism_config_dp_shard_size", "2"], {"parallelism_config": {"parallelism_config_dp_shard_size": 2}},
     "parallelism.dp_shard_size"),
    (["--parallelism_config_cp_size", "2"], {"parallelism_config": {"parallelism_config_cp_size": 2}},
     "parallelism.cp_size"),
    (["--dynamo_backend", "inductor"], {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "compile.backend"),
    (["--dynamo_mode", "max-autotune"], {"dynamo_config": {"dynamo_mode": "max-autotune"}}, "compile.mode"),
]


@pytest.mark.parametrize("flags, accelerate_config, key", CASES, ids=[c[0][0] for c in CASES])
def test_a_flag_sets_the_key_its_config_file_entry_sets_and_show_names_it(capsys, flags, accelerate_config, key):
    distributed = "FSDP" if "fsdp_config" in accelerate_config else "NO"
    tree, _ = convert({"distributed_type": distributed, **accelerate_config})
    section, _, name = key.partition(".")
    rows = shown(capsys, *flags)
    assert rows[key][1] == f"command line {flags[0]}", rows[key]
    import json

    assert json.loads(rows[key][0]) == tree[section][name]


def test_dynamo_flags_turn_compiling_on_with_the_switches_taking_no_value(capsys):
    rows = shown(capsys, "--dynamo_backend", "inductor", "--dynamo_use_fullgraph", "--dynamo_use_dynamic",
                 "--dynamo_use_regional_compilation")
    assert rows["compile.enabled"] == ("true", "command line --dynamo_backend")
    assert rows["compile.fullgraph"] == ("true", "command line --dynamo_use_fullgraph")
    assert rows["compile.dynamic"] == ("true", "command line --dynamo_use_dynamic")
    assert rows["compile.regional"] == ("true", "command line --dynamo_use_regional_compilation")
    off = shown(capsys, "--dynamo_backend", "no")  # Accelerate's default: no compiling, nothing set
    assert off["compile.enabled"][1] != "command line --dynamo_backend"


def test_a_dynamo_switch_before_the_script_leaves_the_script_alone(tmp_path):
    from torchbay.cli.accelerate_flags import AccelerateLaunchFlags
    from torchbay.cli.main import _subparser, build_parser

    flags = AccelerateLaunchFlags(_subparser(build_parser(), "launch"))
    assert flags.translate(["--dynamo_use_fullgraph", "train.py", "--lr", "1"]) == \
        ["--set=compile.fullgraph=true", "train.py", "--lr", "1"]


def test_launch_flags_of_torchrun_and_threads(capsys):
    rows = shown(capsys, "--num_cpu_threads_per_process", "3", "--tee", "3", "--log_dir", "logs",
                 "--rdzv_conf", "join_timeout=30")
    assert rows["launch.cpu_threads_per_process"] == ("3", "command line --num_cpu_threads_per_process")
    assert rows["launch.tee"] == ('"3"', "command line --tee")
    assert rows["launch.log_dir"] == ('"logs"', "command line --log_dir")
    assert rows["launch.rdzv_conf"] == ('"join_timeout=30"', "command line --rdzv_conf")


def test_torchrun_gets_tee_log_dir_and_rdzv_conf(capsys, tmp_path):
    (tmp_path / "t.py").write_text("")
    code = main(["launch", "--dry-run", "--num_processes", "2", "--tee", "3", "--log_dir", "logs",
                 "--rdzv_conf", "join_timeout=30", "t.py"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "--tee 3 --log-dir logs --rdzv-conf join_timeout=30" in out, out


def test_threads_flag_sets_omp_in_every_worker(capsys, tmp_path):
    (tmp_path / "t.py").write_text("")
    code = main(["launch", "--dry-run", "--num_processes", "2", "--num_cpu_threads_per_process", "5", "t.py"])
    out, err = capsys.readouterr()
    assert code == 0 and "OMP_NUM_THREADS=5" in out, out + err


def test_a_flag_torchbay_cannot_honour_says_why(capsys):
    code = main(["config", "show", "--fsdp_state_dict_type", "FULL_STATE_DICT"])
    err = capsys.readouterr().err
    assert code == 2 and "--fsdp_state_dict_type FULL_STATE_DICT is accelerate launch's" in err
    assert "save_model full safetensors" in err
    # SHARDED_STATE_DICT is what save_state writes: accepted, nothing to set
    assert main(["config", "show", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"]) == 0


def test_fsdp_sync_module_states_true_is_accepted(capsys):
    assert main(["config", "show", "--fsdp_sync_module_states", "true"]) == 0


def test_deepspeed_flags_map_onto_the_deepspeed_section(capsys):
    pytest.importorskip("torchbay_deepspeed")
    rows = shown(capsys, "--use_deepspeed", "--zero3_init_flag", "true", "--gradient_clipping", "1.0")
    assert rows["deepspeed.zero3_init"] == ("true", "command line --zero3_init_flag")
    assert rows["deepspeed.gradient_clipping"] == ("1.0", "command line --gradient_clipping")
    assert rows["strategy"] == ('"deepspeed"', "command line --use_deepspeed")
