"""The ``accelerate`` command and Accelerate's launcher helpers under the switch (issue 36): the console script's
entry point (accelerate.commands.accelerate_cli:main) runs torchbay's commands with Accelerate's spellings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = "import sys\nfrom accelerate.commands.accelerate_cli import main\nsys.exit(main())\n"


def accelerate(*argv, cwd, env=None):
    """``accelerate ARGV`` as the installed console script runs it, with the switch on."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHBAY_", "OMP_NUM_THREADS"))}
    full.update({"TORCHBAY_AS_ACCELERATE": "1", "HF_HOME": str(cwd / "hf")}, **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT / "core"), full.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", "from torchbay.compat import as_accelerate; as_accelerate()\n" + CLI,
                           *argv], cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


def test_config_default_then_launch_trains_in_two_processes(tmp_path):
    written = accelerate("config", "default", "--config_file", "acc.yaml", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    config = json.loads((tmp_path / "acc.yaml").read_text())
    assert config["compute_environment"] == "LOCAL_MACHINE" and config["mixed_precision"] == "no"
    again = accelerate("config", "default", "--config_file", "acc.yaml", cwd=tmp_path)
    assert "Will not override existing file" in again.stdout  # left as it is
    (tmp_path / "train.py").write_text("import os\nprint('RANK', os.environ['RANK'], flush=True)\n")
    ran = accelerate("launch", "--config_file", "acc.yaml", "--num_processes", "2", "train.py", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert sorted(line for line in ran.stdout.splitlines() if line.startswith("RANK")) == ["RANK 0", "RANK 1"]


def test_env_answers(tmp_path):
    done = accelerate("env", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "`Accelerate` version: 1.15.0+torchbay" in done.stdout and "torch" in done.stdout


def test_a_failure_names_torchbay_launch_as_accelerate(tmp_path):
    (tmp_path / "t.py").write_text("")
    refused = accelerate("launch", "--fsdp_state_dict_type", "FULL_STATE_DICT", "t.py", cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "torchbay launch --as-accelerate" in refused.stderr
    (tmp_path / "a_file").write_text("")
    crashed = accelerate("config", "default", "--config_file", "a_file/x.yaml", cwd=tmp_path)  # not a folder
    assert crashed.returncode == 1 and "Traceback" in crashed.stderr
    assert "torchbay launch --as-accelerate" in crashed.stderr.splitlines()[-1]


def test_unknown_command_lists_the_served_ones(tmp_path):
    done = accelerate("warp-drive", cwd=tmp_path)
    assert done.returncode == 2 and "unknown command 'warp-drive'" in done.stderr
    assert "launch" in done.stderr and "estimate-memory" in done.stderr and "tpu-config" in done.stderr


# --- commands a plugin serves (its accelerate.yaml, api: commands) -----------------------------------------------

def test_tpu_config_is_served_by_the_xla_plugin_from_flags_and_the_config_file(tmp_path):
    (tmp_path / "setup.sh").write_text("pip install -r requirements.txt\n")
    (tmp_path / "acc.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\n"
                                       "tpu_name: pod\ntpu_zone: europe-west4-a\ncommand_file: setup.sh\n")
    done = accelerate("tpu-config", "--config_file", "acc.yaml", "--install_accelerate", "--debug", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("Running gcloud compute tpus tpu-vm ssh pod --zone europe-west4-a --command "
                                   "cd /usr/share; pip install accelerate -U; pip install -r requirements.txt "
                                   "--worker all")
    missing = accelerate("tpu-config", "--command", "ls", "--debug", cwd=tmp_path)  # no pod named anywhere
    assert missing.returncode == 2 and "--tpu_name" in missing.stderr and "--tpu_zone" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_a_plugin_command_without_its_plugin_names_the_distribution(tmp_path):
    done = accelerate("tpu-config", "--debug", cwd=tmp_path, env={"TORCHBAY_BLOCK_PLUGINS": "xla"})
    assert done.returncode == 2 and "pip install torchbay-xla" in done.stderr and "Traceback" not in done.stderr


def test_a_sagemaker_config_is_read_and_its_launch_refused(tmp_path):
    (tmp_path / "sm.yaml").write_text("compute_environment: AMAZON_SAGEMAKER\ndebug: false\ndistributed_type: NO\n"
                                      "mixed_precision: fp16\ndebug: false\nec2_instance_type: MY_TYPE\n"
                                      "iam_role_name: MY_ROLE\n")  # a key repeated with one value, as Accelerate's
    from torchbay.cli.accelerate.commands import ClusterConfig, SageMakerConfig, load_config_from_file

    read = load_config_from_file(str(tmp_path / "sm.yaml"))
    assert isinstance(read, SageMakerConfig) and not isinstance(read, ClusterConfig)
    assert read.ec2_instance_type == "MY_TYPE" and read.iam_role_name == "MY_ROLE"
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    refused = accelerate("launch", "--config_file", "sm.yaml", "train.py", cwd=tmp_path)
    assert refused.returncode == 2 and "does not submit SageMaker jobs" in refused.stderr, refused.stderr
    assert not (tmp_path / "ran").exists()


# --- the launcher helpers (torchbay.utils, accelerate.utils under the switch) -----------------------------------

def test_convert_dict_to_env_variables_skips_unsafe_ones(caplog):
    from torchbay.utils import convert_dict_to_env_variables

    env = {"A": "1", "BAD": "<x", "EMPTY": "", "B": "2"}
    assert convert_dict_to_env_variables(env) == ["A=1\n", "B=2\n"]
    assert "BAD" in caplog.text and "EMPTY" in caplog.text


def test_convert_nargs_to_dict_types_values():
    from torchbay.utils import _convert_nargs_to_dict

    got = _convert_nargs_to_dict(["--name", "bert", "--do_train", "False", "--epochs", "3", "--lr", "5e-5"])
    assert got == {"name": "bert", "do_train": False, "epochs": 3, "lr": 5e-5}
    with pytest.raises(ValueError, match="--do_test has no value"):
        _convert_nargs_to_dict(["--do_test", "--epochs", "3"])


def test_write_basic_config_writes_a_new_file_only(tmp_path, capsys):
    from torchbay.cli.accelerate.commands import load_config_from_file
    from torchbay.utils import write_basic_config

    path = tmp_path / "default_config.yaml"
    assert write_basic_config("bf16", str(path)) == str(path)
    settings = load_config_from_file(str(path)).to_dict()
    assert settings["mixed_precision"] == "bf16" and settings["distributed_type"] in ("NO", "MULTI_GPU", "MULTI_XPU")
    before = path.read_text()
    assert write_basic_config("no", str(path)) is False and path.read_text() == before


def test_prepare_multi_gpu_env_picks_a_free_port_and_gives_torchbays_env():
    import argparse

    from torchbay.utils import prepare_multi_gpu_env

    args = argparse.Namespace(num_processes=2, num_machines=1, machine_rank=0, main_process_ip="127.0.0.1",
                              main_process_port=0, mixed_precision="no", gpu_ids="all", cpu=True,
                              num_cpu_threads_per_process=2)
    env = prepare_multi_gpu_env(args)
    assert args.master_port.isdigit() and args.master_port != "0" and args.nproc_per_node == "2"
    assert "TORCHBAY_RESOLVED_CONFIG" in env and env["OMP_NUM_THREADS"] == "2"


def test_prepare_simple_launcher_cmd_env():
    import argparse

    from torchbay.utils import prepare_simple_launcher_cmd_env

    args = argparse.Namespace(training_script="train.py", training_script_args=["--lr", "1"], module=False,
                              no_python=False, cpu=True, num_processes=1, mixed_precision="no")
    cmd, env = prepare_simple_launcher_cmd_env(args)
    assert cmd == [sys.executable, "train.py", "--lr", "1"] and "TORCHBAY_RESOLVED_CONFIG" in env
