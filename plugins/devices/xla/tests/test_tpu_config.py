"""``accelerate tpu-config`` as torchbay-xla serves it: the gcloud command assembled from the flags and the
Accelerate config file, printed with --debug, and run without a shell otherwise (a ``gcloud`` on PATH that records
the arguments it was given stands for the Google Cloud CLI)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from torchbay_xla import tpu_config

from torchbay.errors import ConfigError, LaunchError

GCLOUD = ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]


@pytest.fixture(autouse=True)
def no_default_config(tmp_path, monkeypatch):
    """Accelerate's default config file of this machine is not read (each test names its own, or none)."""
    monkeypatch.setattr(tpu_config, "default_config_file", str(tmp_path / "absent" / "default_config.yaml"))


def parse(*argv):
    return tpu_config.tpu_command_parser().parse_args(list(argv))


def assembled(*argv):
    return tpu_config.gcloud_command(*tpu_config.pod_settings(parse(*argv)), use_alpha=parse(*argv).use_alpha)


def write(path, text):
    path.write_text(text)
    return str(path)


def test_flags_alone_make_the_gcloud_command():
    assert assembled("--tpu_name", "pod", "--tpu_zone", "us-central1-a", "--command", "ls") == [
        *GCLOUD, "pod", "--zone", "us-central1-a", "--command", "cd /usr/share; ls", "--worker", "all"]


def test_commands_keep_their_order_and_hyphenated_flags_are_accepted():
    command = assembled("--tpu-name", "pod", "--tpu-zone", "z", "--command", "ls", "--command", 'echo "a b"',
                        "--use-alpha")
    assert command[:2] == ["gcloud", "alpha"]
    assert command[command.index("--command") + 1] == 'cd /usr/share; ls; echo "a b"'


def test_the_config_file_gives_the_pod_and_its_command_file(tmp_path):
    commands = write(tmp_path / "setup.sh", "#!/bin/bash\necho one\n\n# a comment\necho two\n")
    config = write(tmp_path / "acc.yaml", f"compute_environment: LOCAL_MACHINE\ntpu_name: pod\ntpu_zone: z\n"
                                          f"commands: null\ncommand_file: {commands}\n")
    assert assembled("--config_file", config) == [*GCLOUD, "pod", "--zone", "z", "--command",
                                                  "cd /usr/share; echo one; echo two", "--worker", "all"]


def test_flags_win_over_the_config_file(tmp_path):
    config = write(tmp_path / "acc.yaml", "tpu_name: pod\ntpu_zone: z\ncommands: [make]\n")
    command = assembled("--config_file", config, "--tpu_name", "other", "--command", "ls")
    assert command[5:8] == ["other", "--zone", "z"] and command[command.index("--command") + 1] == "cd /usr/share; ls"
    assert assembled("--config_file", config)[-3] == "cd /usr/share; make"  # the file's commands


def test_accelerates_default_config_file_is_read_when_none_is_named(tmp_path, monkeypatch):
    default = write(tmp_path / "default_config.yaml", "tpu_name: pod\ntpu_zone: z\ncommands: [ls]\n")
    monkeypatch.setattr(tpu_config, "default_config_file", default)
    assert assembled()[5:8] == ["pod", "--zone", "z"]


@pytest.mark.parametrize("version, step", [("latest", "pip install accelerate -U"),
                                           ("1.15.0", "pip install accelerate==1.15.0"),
                                           ("dev", f"pip install {tpu_config.ACCELERATE_DEV}")])
def test_install_accelerate_runs_first(version, step):
    command = assembled("--tpu_name", "p", "--tpu_zone", "z", "--command", "ls", "--install_accelerate",
                        "--accelerate_version", version)
    assert command[command.index("--command") + 1] == f"cd /usr/share; {step}; ls"


def test_a_version_the_remote_shell_would_read_as_commands_is_refused():
    with pytest.raises(ConfigError, match="--accelerate_version '1.0; rm -rf ~' is not a version"):
        assembled("--tpu_name", "p", "--tpu_zone", "z", "--command", "ls", "--install_accelerate",
                  "--accelerate_version", "1.0; rm -rf ~")


def test_every_missing_setting_is_named_at_once(tmp_path):
    config = write(tmp_path / "acc.yaml", "compute_environment: LOCAL_MACHINE\n")  # an old file: no tpu keys
    with pytest.raises(ConfigError) as failed:
        assembled("--config_file", config)
    said = str(failed.value)
    assert "--tpu_name" in said and "--tpu_zone" in said and "--command" in said and config in said


def test_command_and_command_file_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        assembled("--tpu_name", "p", "--tpu_zone", "z", "--command", "ls", "--command_file",
                  write(tmp_path / "c.sh", "ls\n"))
    with pytest.raises(ConfigError, match="--command_file .*missing.sh cannot be read"):
        assembled("--tpu_name", "p", "--tpu_zone", "z", "--command_file", str(tmp_path / "missing.sh"))


def test_debug_prints_the_command_instead_of_running_it(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "")  # no gcloud: nothing may run
    assert tpu_config.main(["--tpu_name", "p", "--tpu_zone", "z", "--command", "ls", "--debug"]) == 0
    assert capsys.readouterr().out == ("Running gcloud compute tpus tpu-vm ssh p --zone z --command cd /usr/share; ls "
                                       "--worker all\n")


def _fake_gcloud(folder, exit_code=0):
    """A ``gcloud`` executable that writes the arguments it received to args.json."""
    folder.mkdir()
    script = folder / "gcloud"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"json.dump(sys.argv[1:], open({str(folder / 'args.json')!r}, 'w'))\nsys.exit({exit_code})\n")
    script.chmod(0o755)
    return folder


@pytest.mark.skipif(os.name == "nt", reason="a script as gcloud needs a POSIX shebang")
def test_without_debug_gcloud_runs_with_the_arguments_as_given(tmp_path, monkeypatch, capsys):
    folder = _fake_gcloud(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(folder))
    argv = ["--tpu_name", "p", "--tpu_zone", "z", "--command", 'echo "$HOME" > out; ls *']
    assert tpu_config.main(argv) == 0
    assert json.loads((folder / "args.json").read_text()) == [
        "compute", "tpus", "tpu-vm", "ssh", "p", "--zone", "z", "--command", 'cd /usr/share; echo "$HOME" > out; ls *',
        "--worker", "all"]  # no local shell: the remote one gets the string untouched
    assert "Successfully setup pod." in capsys.readouterr().out


@pytest.mark.skipif(os.name == "nt", reason="a script as gcloud needs a POSIX shebang")
def test_a_failing_gcloud_is_the_commands_exit_code(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(_fake_gcloud(tmp_path / "bin", exit_code=3)))
    assert tpu_config.main(["--tpu_name", "p", "--tpu_zone", "z", "--command", "ls"]) == 3
    assert "gcloud failed with exit code 3" in capsys.readouterr().err


def test_without_gcloud_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(LaunchError, match="Google Cloud CLI"):
        tpu_config.main(["--tpu_name", "p", "--tpu_zone", "z", "--command", "ls"])
