"""``accelerate launch``'s namespace (issue 36): ``launch_command_parser()`` gives Accelerate's attributes, made from
torchbay launch's flags and the one Accelerate table; ``_validate_launch_command`` completes them from the config
file as Accelerate does; ``launch_command`` gives torchbay launch what the namespace was given;
``prepare_simple_launcher_cmd_env`` gives the installed MPI's command line and ``--cpu``'s OpenMP variables."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from torchbay.cli.accelerate.commands import _validate_launch_command, launch_command, launch_command_parser
from torchbay.cli.accelerate.launch_helpers import prepare_simple_launcher_cmd_env
from torchbay.cli.accelerate.launch_namespace import launch_tokens
from torchbay.errors import LaunchError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./torchbay.yaml found by accident
    for name in ("TORCHBAY_CONFIG_FILE", "TORCHBAY_RESOLVED_CONFIG", "KMP_AFFINITY", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("torchbay.compat.accelerate_config_file.default_config_file", str(tmp_path / "none.yaml"))


@pytest.fixture(scope="module")
def parser():
    return launch_command_parser()


def accelerate_config(tmp_path, text: str) -> str:
    path = tmp_path / "acc.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


# --- the namespace -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--multi_gpu", "--use_fsdp", "--num_processes", "4"],
                                   ["--multi-gpu", "--use-fsdp", "--num-processes", "4"]], ids=["_", "-"])
def test_both_spellings_give_accelerates_attributes(parser, flags):
    args = parser.parse_args([*flags, "train.py", "--lr", "1"])
    assert args.multi_gpu is True and args.use_fsdp is True and args.num_processes == 4
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "1"]
    assert args.nondefault == {"multi_gpu", "use_fsdp", "num_processes", "training_script", "training_script_args"}


def test_what_is_not_given_holds_accelerates_defaults(parser):
    args = parser.parse_args(["train.py"])
    assert args.multi_gpu is False and args.cpu is False and args.debug is False and args.use_deepspeed is False
    assert args.num_processes is None and args.config_file is None and args.mpirun_hostfile is None
    assert args.dry_run is False  # torchbay launch's own flags are there too, under Accelerate's spelling


def test_every_row_of_the_table_is_an_attribute(parser, monkeypatch):
    from torchbay.compat import config_import

    table = config_import.mapping_table()
    names = set(vars(parser.parse_args(["t.py"])))
    expected = {*table["launch_switches"], *table["launch_values"], *table["launch_refused"]}
    for spec in table["sections"].values():
        expected |= {config_import.flag_of(spec, key) for key in spec.get("keys", {})} if "target" in spec else set()
    assert expected <= names
    # one table: a row added there is an attribute here, with nothing else to change
    grown = {**table, "launch_switches": {**table["launch_switches"], "use_example": {"strategy": "ddp"}}}
    monkeypatch.setattr(config_import, "mapping_table", lambda pm=None: grown)
    assert launch_command_parser().parse_args(["--use-example", "t.py"]).use_example is True


def test_an_unknown_flag_is_one_line_with_the_nearest(parser, capsys):
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--num_procesess", "2", "t.py"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "did you mean --num" in err and len(err.strip().splitlines()) == 1


def test_help_lists_each_flag_once_with_accelerates_spelling(parser):
    shown = parser.format_help()
    assert "--num_processes" in shown and "--use_fsdp" in shown and "--use-fsdp" not in shown
    assert shown.count("--num-processes") == 1  # the description's example only


# --- _validate_launch_command --------------------------------------------------------------------------------------

def test_validate_fills_what_the_command_line_did_not_give(parser, tmp_path):
    pytest.importorskip("torchbay_fsdp")
    config = accelerate_config(tmp_path, """\
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        debug: true
        num_processes: 1
        mixed_precision: bf16
        fsdp_config:
          fsdp_sync_module_states: false
          fsdp_offload_params: true
        """)
    args = parser.parse_args(["--num_processes", "2", "--fsdp_offload_params", "false", "--config_file", config,
                              "t.py"])
    assert args.fsdp_sync_module_states == "true" and args.debug is False  # Accelerate's flag defaults
    args, settings, mixed_from_file = _validate_launch_command(args)
    assert args.debug is True and args.mixed_precision == "bf16" and mixed_from_file is True
    assert args.num_processes == 2 and args.fsdp_offload_params == "false"  # given: kept
    assert args.fsdp_sync_module_states is False  # a nested config's key fills its flag's attribute
    assert args.use_fsdp is True and args.multi_gpu is False and settings.distributed_type == "FSDP"


@pytest.mark.parametrize("distributed_type, switches", [("NO", []), ("MULTI_CPU", []), ("FSDP", ["use_fsdp"]),
                                                        ("MULTI_GPU", ["multi_gpu"])])
def test_the_switches_stand_for_the_files_distributed_type(distributed_type, switches):
    from torchbay.cli.accelerate.launch_validation import switches_for
    from torchbay.compat.config_import import mapping_table

    table = mapping_table()
    if distributed_type not in table["distributed_type"]:
        pytest.skip(f"no installed plugin maps {distributed_type}")
    assert switches_for(distributed_type, table) == switches


def test_an_unknown_key_is_refused_as_accelerate_refuses_it(parser, tmp_path):
    config = accelerate_config(tmp_path, "distributed_type: 'NO'\nnum_processes: 1\ninvalid_key: 1\n")
    with pytest.raises(ValueError, match=r"unknown keys \(invalid_key\)"):
        _validate_launch_command(parser.parse_args(["--config_file", config, "t.py"]))
    with pytest.raises(ValueError, match=r"unknown keys \(invalid_key\)"):  # and no launch starts
        launch_command(parser.parse_args(["--config_file", config, "t.py"]))


def test_conflicting_switches_are_refused(parser):
    pytest.importorskip("torchbay_fsdp")
    with pytest.raises(ValueError, match="--multi_gpu and --use_fsdp choose different set-ups"):
        _validate_launch_command(parser.parse_args(["--multi_gpu", "--use_fsdp", "t.py"]))


def test_without_a_config_the_machine_decides(parser):
    args, settings, _ = _validate_launch_command(parser.parse_args(["t.py"]))
    assert settings is None and args.num_processes >= 1 and args.num_machines == 1 and args.mixed_precision == "no"


# --- launch_command ------------------------------------------------------------------------------------------------

def test_launch_gives_torchbay_what_was_given_or_changed_not_what_the_file_filled(parser, tmp_path):
    config = accelerate_config(tmp_path, "distributed_type: MULTI_CPU\nnum_processes: 4\ndebug: true\n")
    args = parser.parse_args(["--config_file", config, "--num_processes", "2", "-m", "pkg.train"])
    args.training_script_args = ["--lr", "1"]  # as trl's CLI does, between parsing and launching
    _validate_launch_command(args)
    assert args.debug is True  # (--debug would be refused by torchbay launch: the file's is imported with it)
    assert launch_tokens(parser, args) == [f"--config_file={config}", "--num_processes=2", "--module", "pkg.train",
                                           "--lr", "1"]


def test_launch_command_runs_torchbay_launch_with_the_namespace(parser, tmp_path, capsys):
    (tmp_path / "t.py").write_text("")
    args = parser.parse_args(["--dry_run", "--cpu", "--num_processes", "2", "t.py"])
    args.training_script_args = ["--lr", "1"]
    launch_command(args)
    out = capsys.readouterr().out
    assert "device cpu" in out and "t.py --lr 1" in out, out


# --- prepare_simple_launcher_cmd_env -------------------------------------------------------------------------------

def _mpi_on_path(tmp_path, monkeypatch, says: str | None) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    if says is not None:
        program = folder / "mpirun"
        program.write_text(f"#!/bin/sh\necho '{says}'\n")
        program.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))


MPI_CONFIG = """\
    distributed_type: MULTI_CPU
    use_cpu: true
    num_processes: 8
    num_machines: 2
    main_process_ip: 127.0.0.1
    main_process_port: 29500
    mpirun_config:
      mpirun_hostfile: hosts
    """


@pytest.mark.parametrize("says, expected", [
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", ["mpirun", "-f", "hosts", "-ppn", "4", "-n", "8"]),
    ("mpirun (Open MPI) 4.1.5", ["mpirun", "--hostfile", "hosts", "--npernode", "4", "-n", "8", "--bind-to", "socket"]),
], ids=["intel", "openmpi"])
def test_an_mpirun_config_gives_the_installed_mpis_command_line(parser, tmp_path, monkeypatch, says, expected):
    args, _, _ = _validate_launch_command(parser.parse_args(["--config_file", accelerate_config(tmp_path, MPI_CONFIG),
                                                             "t.py", "--x"]))
    assert args.mpirun_hostfile == "hosts"
    _mpi_on_path(tmp_path, monkeypatch, says)
    cmd, _ = prepare_simple_launcher_cmd_env(args)
    assert cmd == [*expected, sys.executable, "t.py", "--x"]


def test_an_mpirun_config_without_mpi_says_what_to_install(parser, tmp_path, monkeypatch):
    args, _, _ = _validate_launch_command(parser.parse_args(["--config_file", accelerate_config(tmp_path, MPI_CONFIG),
                                                             "t.py"]))
    _mpi_on_path(tmp_path, monkeypatch, None)
    with pytest.raises(LaunchError, match="mpirun_hostfile hosts .* install Open MPI"):
        prepare_simple_launcher_cmd_env(args)


def test_cpu_gives_the_intel_openmp_variables_and_nothing_else_does(parser, monkeypatch):
    args, _, _ = _validate_launch_command(parser.parse_args(["--cpu", "t.py"]))
    _, env = prepare_simple_launcher_cmd_env(args)
    assert env["KMP_AFFINITY"] == "granularity=fine,compact,1,0" and env["KMP_BLOCKTIME"] == "1"
    monkeypatch.setenv("KMP_BLOCKTIME", "0")  # the user's own value stays
    assert prepare_simple_launcher_cmd_env(args)[1]["KMP_BLOCKTIME"] == "0"
    monkeypatch.delenv("KMP_BLOCKTIME")
    args, _, _ = _validate_launch_command(parser.parse_args(["t.py"]))
    _, env = prepare_simple_launcher_cmd_env(args)
    assert "KMP_AFFINITY" not in env and "KMP_BLOCKTIME" not in env


def test_under_the_switch_accelerate_utils_launch_is_the_helpers_module():
    code = textwrap.dedent("""
        import json
        from unittest.mock import patch
        import accelerate.utils.launch as launch
        import torchbay.utils
        from torchbay.cli.accelerate import launch_helpers
        with patch("accelerate.utils.launch.which", return_value=None):  # as Accelerate's tests patch it
            patched = launch_helpers.which("sh")
        print(json.dumps({"patched": patched, "restored": launch_helpers.which("sh") is not None,
                          "helper": launch.prepare_simple_launcher_cmd_env is
                          launch_helpers.prepare_simple_launcher_cmd_env,
                          "utils_name": launch.str_to_bool is torchbay.utils.str_to_bool}))
        """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    env.update(TORCHBAY_AS_ACCELERATE="1", PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "core"),
                                                                        env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"patched": None, "restored": True, "helper": True,
                                                                "utils_name": True}
