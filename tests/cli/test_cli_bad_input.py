"""Bad input of every kind: one line that names the setting and the fix, exit code 2, nothing
written, no traceback. The cases named in issue 13 also run through the real ``torchbay``
command in a subprocess; the rest call the same ``main`` in this process (quicker)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from torchbay.cli.main import main

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = str(TESTS / "scripts" / "cli_ranks.py")
LATIN1 = b"seed: 1\nproject:\n  project_dir: caf\xe9\n"

# name: (file content, what the one line must say)
BAD_FILES = {
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00\x00", "is a binary file, not YAML text"),
    "utf-16": ("seed: 1\n".encode("utf-16"), "is UTF-16 encoded; save it as UTF-8"),
    "latin-1": (LATIN1, "is not UTF-8 text (byte 0xe9 on line 3"),
    "duplicate key": (b"seed: 1\nmixed_precision: bf16\nseed: 2\n", "duplicate key 'seed' on lines 1 and 3"),
    "duplicate nested key": (b"dataloader:\n  even_batches: true\n  even_batches: false\n",
                             "duplicate key 'even_batches' on lines 2 and 3"),
    "number as key": (b"1: cpu\n", "key 1 is not a name"),
    "tab indentation": (b"launch:\n\tnum_processes: 2\n", "is not valid YAML"),
    "fp8 backend unknown with bf16": (b"mixed_precision: bf16\nfp8:\n  backend: nosuch\n",
                                      "fp8.backend 'nosuch' is not an installed FP8 engine (installed engines:"),
    "fp8 backend unknown with fp8": (b"mixed_precision: fp8\nfp8:\n  backend: nosuch\n",
                                     "fp8 backend 'nosuch' is not installed (installed engines:"),
    "unknown device": (b"device: warpdrive\n", "device 'warpdrive' is not installed"),
    "negative processes": (b"launch:\n  num_processes: -1\n", "launch.num_processes"),
    "zero monitor interval": (b"launch:\n  monitor_interval: 0\n", "launch.monitor_interval"),
    "bad visible devices": (b"visible_devices: '0;1'\n", "visible_devices"),
    "unknown checkpoint io": (b"checkpoint:\n  io: tape\n", "checkpoint io 'tape' is not installed"),
    "zero timeout": (b"process_group_timeout_s: 0\n", "process_group_timeout_s"),
    "section as scalar": (b"dataloader: 5\n", "'dataloader' = 5"),
    "required plugin missing": (b"plugins:\n  required: [torchbay-nosuch]\n",
                                "required plugin 'torchbay-nosuch' is not installed: pip install torchbay-nosuch"),
    "renamed nested key": (b"fp8_backend: te\n", "it now lives at 'fp8.backend'"),
}

SETUP_PROBLEMS = {"fp8 backend unknown with bf16", "fp8 backend unknown with fp8", "unknown device",
                  "unknown checkpoint io", "required plugin missing"}


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code, out, err, expected, command):
    assert code == 2, (code, out, err)
    assert expected in err, err
    assert "Traceback" not in err + out
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("torchbay: plugin")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"torchbay {command}: error:") or lines[0].startswith("torchbay: error:"), err


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A clean current folder: nothing may be written into it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    yield work
    assert sorted(p.name for p in work.iterdir()) == [], "a refused command wrote files"


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_config_files(capsys, tmp_path, workdir, case):
    content, expected = BAD_FILES[case]
    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(content)
    commands = [["config", "validate", str(cfg)], ["launch", "--dry-run", "--config-file", str(cfg), SCRIPT]]
    if case not in SETUP_PROBLEMS:  # config show prints a config; only validate and launch check the set-up
        commands.append(["config", "show", "--config-file", str(cfg)])
    for argv in commands:
        code, out, err = run(capsys, *argv)
        assert_one_line(code, out, err, expected, argv[0])


@pytest.mark.parametrize("case", ["binary", "utf-16", "latin-1", "duplicate key"])
def test_bad_accelerate_files(capsys, tmp_path, workdir, case):
    content, expected = BAD_FILES[case]
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_bytes(content)
    code, out, err = run(capsys, "config", "import-accelerate", str(cfg), "-o", str(workdir / "out.yaml"))
    assert_one_line(code, out, err, expected, "config")


BAD_COMMANDS = {
    "script is a directory": (["launch", str(TESTS / "scripts")], "is a directory, not a Python file"),
    "config file is a directory": (["launch", "--config-file", str(TESTS), SCRIPT], "is a directory, not a file"),
    "validate a directory": (["config", "validate", str(TESTS)], "is a directory, not a file"),
    "missing module": (["launch", "-m", "no_such_module_xyz"], "module 'no_such_module_xyz' (given with -m)"),
    "abbreviated flag": (["launch", "--nproc", "2", SCRIPT], "unrecognized option --nproc; did you mean"),
    "factory needs arguments": (["estimate-memory", "torch.nn:Linear"], "needs arguments (in_features, out_features)"),
    "class needs arguments": (["estimate-memory", "json:JSONDecodeError"], "needs arguments (msg, doc, pos)"),
    "port zero": (["launch", "--dry-run", "--main-process-port", "0", SCRIPT], "launch.main_process_port"),
    "negative restarts": (["launch", "--dry-run", "--max-restarts", "-1", SCRIPT], "launch.max_restarts"),
    "rendezvous without endpoint": (["launch", "--dry-run", "--num-machines", "2", "--rdzv-backend", "c10d", SCRIPT],
                                    "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT"),
    "fractional accumulation": (["launch", "--dry-run", "--gradient-accumulation-steps", "1.5", SCRIPT],
                                "gradient_accumulation_steps"),
    "empty --set key": (["launch", "--dry-run", "--set", "=3", SCRIPT], "expected KEY=VALUE"),
    "section set to a scalar": (["launch", "--dry-run", "--set", "fp8=3", SCRIPT], "'fp8' = 3"),
    "fp8 engine not installed": (["launch", "--dry-run", "--mixed-precision", "fp8", "--fp8-backend", "nosuch", SCRIPT],
                                 "fp8 backend 'nosuch' is not installed"),
    "-p without a name": (["-p"], "-p needs a plugin name"),
    "unknown command": (["lauch"], "invalid choice: 'lauch'"),
    "output in a missing folder": (["config", "--default", "-o", "/nonexistent/dir/x.yaml"],
                                   "the folder /nonexistent/dir does not exist"),
    "output is a directory": (["config", "--default", "-o", str(TESTS), "--force"], "is a directory; give a file name"),
    "import output is a directory": (["config", "import-accelerate", str(TESTS / "fixtures" / "accelerate" /
                                                                         "single_cpu.yaml"), "-o", str(TESTS)],
                                     "is a directory; give a file name"),
}


@pytest.mark.parametrize("case", sorted(BAD_COMMANDS))
def test_bad_command_lines(capsys, workdir, case):
    argv, expected = BAD_COMMANDS[case]
    code, out, err = run(capsys, *argv)
    assert_one_line(code, out, err, expected, argv[0])


def test_config_file_from_the_environment_that_is_a_directory(capsys, workdir, monkeypatch):
    monkeypatch.setenv("TORCHBAY_CONFIG_FILE", str(TESTS))
    code, out, err = run(capsys, "config", "show")
    assert_one_line(code, out, err, "is a directory, not a file (set --config-file or TORCHBAY_CONFIG_FILE", "config")


def test_fp8_section_without_fp8_is_a_warning(capsys, tmp_path, workdir, caplog):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mixed_precision: bf16\nfp8:\n  backend: te\n  margin: 1\n")
    code, out, err = run(capsys, "launch", "--dry-run", "--config-file", str(cfg), SCRIPT)
    assert code == 0, err
    assert "fp8.backend, fp8.margin set but mixed_precision is 'bf16'" in caplog.text + err


# --- the issue's cases, through the real command in a subprocess -------------------------------


def cli(*argv, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    return subprocess.run([sys.executable, "-m", "torchbay.cli.main", *argv], capture_output=True, text=True,
                          env=env, cwd=str(cwd), timeout=120)


def test_issue_cases_in_a_subprocess(tmp_path, workdir):
    files = {}
    for case in ("binary", "utf-16", "latin-1", "duplicate key", "fp8 backend unknown with bf16"):
        files[case] = tmp_path / f"{case.replace(' ', '_')}.yaml"
        files[case].write_bytes(BAD_FILES[case][0])
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = [(["launch", "--config-file", str(files[c]), SCRIPT], BAD_FILES[c][1]) for c in files]
    cases += [
        (["config", "import-accelerate", str(files["latin-1"])], BAD_FILES["latin-1"][1]),
        (["launch", "--num-processes", "2", "--main-process-port", str(port), SCRIPT],
         f"main_process_port {port} (from command line --main-process-port) is already in use on this machine"),
        (["estimate-memory", "torch.nn:Linear"], "needs arguments (in_features, out_features)"),
        (["launch", str(TESTS / "scripts")], "is a directory, not a Python file"),
        (["launch", "--config-file", str(TESTS), SCRIPT], "is a directory, not a file"),
    ]
    try:
        for argv, expected in cases:
            result = cli(*argv, cwd=workdir)
            assert_one_line(result.returncode, result.stdout, result.stderr, expected, argv[0])
    finally:
        busy.close()
