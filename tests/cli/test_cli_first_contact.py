"""First contact (issue 28, item 10): what a user coming from Accelerate types, through the real
``torchbay`` command in a subprocess."""

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchbay(*argv, cwd=None, env=None, timeout=300, **kwargs):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHBAY_", "OMP_NUM_THREADS"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "torchbay.cli.main", *argv], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import os\nprint('RANK', os.environ.get('RANK'), 'OMP', os.environ.get('OMP_NUM_THREADS'),"
                    " flush=True)\n")
    return path


# --- a typo is never an invitation to install a name nobody published -----------------------------

@pytest.mark.parametrize("flags, meant", [
    (["--strategy", "fsdpp"], "strategy 'fsdpp' is not installed"),
    (["--device", "gpu"], "device 'gpu' is not installed"),
    (["--log-with", "wandbb"], "tracker 'wandbb' is not installed"),
])
def test_a_value_typo_suggests_the_nearest_name_not_a_new_distribution(tmp_path, script, flags, meant):
    done = torchbay("launch", *flags, str(script), cwd=tmp_path)
    assert done.returncode == 2 and meant in done.stderr, done.stderr
    assert "torchbay-fsdpp" not in done.stderr and "torchbay-gpu" not in done.stderr
    assert "torchbay-wandbb" not in done.stderr
    assert "did you mean" in done.stderr and "Traceback" not in done.stderr


def test_with_no_plugin_installed_a_typo_names_the_published_distribution(tmp_path, script):
    env = {"TORCHBAY_DISABLE_PLUGIN_AUTOLOAD": "1"}  # as right after `pip install torchbay`
    typo = torchbay("launch", "--strategy", "fsdpp", str(script), cwd=tmp_path, env=env)
    assert "did you mean 'fsdp'? (pip install torchbay-fsdp)" in typo.stderr, typo.stderr
    gpu = torchbay("launch", "--device", "gpu", str(script), cwd=tmp_path, env=env)
    assert "did you mean 'cuda'? (pip install torchbay-cuda)" in gpu.stderr, gpu.stderr
    zero = torchbay("launch", "--use_deepspeed", str(script), cwd=tmp_path, env=env)
    assert "--use_deepspeed is accelerate launch's; torchbay launch reads it once torchbay-deepspeed is " \
           "installed: pip install torchbay-deepspeed" in zero.stderr, zero.stderr
    right = torchbay("launch", "--strategy", "fsdp", str(script), cwd=tmp_path, env=env)
    assert "strategy 'fsdp' is not installed (installed: ddp, single); pip install torchbay-fsdp" in right.stderr
    unknown = torchbay("launch", "--device", "warpdrive", str(script), cwd=tmp_path, env=env)
    assert "no plugin torchbay publishes provides device 'warpdrive'" in unknown.stderr, unknown.stderr
    assert "pip install" not in unknown.stderr


def _in_tree_distributions():
    found = {}
    for setup_cfg in sorted((ROOT / "plugins").rglob("setup.cfg")):
        parser = configparser.ConfigParser()
        parser.read(setup_cfg)
        found[parser["metadata"]["name"]] = setup_cfg.parent
    return found


def test_the_catalog_is_what_plugins_in_this_repository_register():
    """Every name an installed in-tree plugin registers is in the catalog under its distribution,
    and the catalog names no distribution that is not in plugins/."""
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.published import catalog
    from torchbay.tracking.trackers import registered

    in_tree = _in_tree_distributions()
    listed = {kind: names for kind, names in catalog().items() if kind != "alias"}
    assert {d for names in listed.values() for d in names.values()} <= set(in_tree)
    pm = get_plugin_manager()
    plugin_distribution = {info.name: info.distribution for info in pm.infos.values()}
    registries = pm.registries()
    registered_by_kind = {
        "device": registries["devices"], "strategy": registries["strategies"], "tracker": registered(pm),
        "fp8 engine": {key.split(":", 1)[1]: cls for key, cls in registries["precisions"].items()
                       if key.startswith("fp8:")},
    }
    for kind, classes in registered_by_kind.items():
        for name, cls in classes.items():
            distribution = plugin_distribution.get(getattr(cls, "_torchbay_plugin", None))
            if distribution in in_tree:
                assert listed[kind].get(name) == distribution, (kind, name)
    for distribution, folder in in_tree.items():  # the accelerate launch switches each plugin's table reads
        for table in folder.rglob("accelerate.yaml"):
            import yaml

            switches = (yaml.safe_load(table.read_text()).get("config_import") or {}).get("launch_switches") or {}
            assert all(listed["accelerate launch switch"].get(s) == distribution for s in switches), distribution
            commands = (yaml.safe_load(table.read_text()).get("api") or {}).get("commands") or {}
            assert all(listed["accelerate command"].get(c) == distribution for c in commands), distribution
    for command, distribution in listed["accelerate command"].items():  # and each listed command is served there
        tables = [yaml.safe_load(t.read_text()) for t in in_tree[distribution].rglob("accelerate.yaml")]
        assert any(command in ((t.get("api") or {}).get("commands") or {}) for t in tables), command
    for section, model in pm.config_sections().items():
        top = model.__module__.split(".")[0]
        distribution = next((d for d, folder in in_tree.items() if (folder / top).is_dir()), None)
        if distribution:
            assert listed["config section"].get(section) == distribution, section


# --- a 2-process launch prints what the user's script prints, and a failure once ------------------

ELASTIC_LOG_LINE = r"(?m)^[WEI]\d{4} \d\d:\d\d:\d\d"


def test_a_two_process_launch_has_no_torchrun_banner_and_sets_the_threads_quietly(tmp_path, script):
    import re

    done = torchbay("launch", "--num-processes", "2", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "OMP_NUM_THREADS" not in done.stderr and not re.search(ELASTIC_LOG_LINE, done.stderr), done.stderr
    threads = str(max(1, (os.cpu_count() or 1) // 2))  # the cpu device: the cores shared out
    assert sorted(done.stdout.split("\n")[:2]) == [f"RANK 0 OMP {threads}", f"RANK 1 OMP {threads}"], done.stdout
    own = torchbay("launch", "--num-processes", "2", str(script), cwd=tmp_path, env={"OMP_NUM_THREADS": "3"})
    assert own.stdout.count("OMP 3") == 2, own.stdout  # the user's own setting wins


def test_a_failing_rank_is_told_once_without_elastics_lines(tmp_path):
    import re

    (tmp_path / "fail.py").write_text("import os, time\nif os.environ['RANK'] == '1':\n    raise ValueError('boom')\n"
                                      "time.sleep(120)  # rank 0 is still running when rank 1 fails\n")
    done = torchbay("launch", "--num-processes", "2", "fail.py", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert done.stderr.count("\nValueError: boom\n") == 1  # the traceback's last line, once
    assert "rank 1 failed first" in done.stderr and not re.search(ELASTIC_LOG_LINE, done.stderr), done.stderr


# --- accelerate launch's spellings -------------------------------------------------------------------

ARGV_SCRIPT = "import sys\nprint('ARGS', sys.argv[1:], flush=True)\n"


def test_accelerate_launch_spellings_are_read_and_the_script_keeps_its_own(tmp_path):
    (tmp_path / "args.py").write_text(ARGV_SCRIPT)
    done = torchbay("launch", "--num_processes", "2", "--mixed_precision=bf16", "--main_process_port", "29517",
                    "--dry-run", "args.py", "--num_processes", "7", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "num_processes = 2  (command line --num-processes)" in done.stdout
    assert "mixed_precision bf16" in done.stdout
    assert done.stdout.rstrip().endswith("args.py --num_processes 7"), done.stdout  # the script's, untouched
    ran = torchbay("launch", "--num_processes", "2", "args.py", "--mixed_precision", "x", cwd=tmp_path)
    assert ran.stdout.count("ARGS ['--mixed_precision', 'x']") == 2, ran.stdout + ran.stderr


def test_accelerate_launch_switches_mean_what_the_same_accelerate_config_means(tmp_path, script):
    cpu = torchbay("launch", "--cpu", "--dry-run", str(script), cwd=tmp_path)
    assert "set-up: device cpu" in cpu.stdout, cpu.stderr
    gpu = torchbay("launch", "--multi_gpu", "--num_processes", "2", "--dry-run", str(script), cwd=tmp_path)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_gpu = False
    # --multi_gpu starts several DDP processes on the device there is, as accelerate launch does on a CPU machine
    device = "cuda" if has_gpu else "cpu"
    assert f"device {device}, strategy ddp" in gpu.stdout, gpu.stdout + gpu.stderr
    # as accelerate launch does: every worker gets OMP_NUM_THREADS=N (issue 36; it used to be refused)
    threads = torchbay("launch", "--num_cpu_threads_per_process", "3", "--num_processes", "2", str(script),
                       cwd=tmp_path)
    assert threads.returncode == 0 and threads.stdout.count("OMP 3") == 2, threads.stdout + threads.stderr


def test_an_unknown_flag_gets_the_nearest_one_and_the_help_to_read(tmp_path, script):
    done = torchbay("launch", "--nproc_per_nod", "2", str(script), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("torchbay launch: error: unrecognized option --nproc_per_nod; did you mean "
                                   "--nproc-per-node? (see torchbay launch --help)"), done.stderr
    show = torchbay("config", "show", "--source", cwd=tmp_path)
    assert "did you mean --sources?" in show.stderr and "torchbay config show --help" in show.stderr, show.stderr


# --- torchbay config writes ./torchbay.yaml and torchbay launch reads it ---------------------------

def test_the_file_torchbay_config_writes_is_read_by_launch_from_its_folder(tmp_path, script):
    wrote = torchbay("config", "--default", cwd=tmp_path)
    assert wrote.returncode == 0 and (tmp_path / "torchbay.yaml").is_file(), wrote.stderr
    assert "torchbay launch run from this folder reads it" in wrote.stderr
    text = (tmp_path / "torchbay.yaml").read_text()
    (tmp_path / "torchbay.yaml").write_text(text.replace("mixed_precision: 'no'", "mixed_precision: bf16")
                                            .replace("mixed_precision: no", "mixed_precision: bf16"))
    plan = torchbay("launch", "--dry-run", str(script), cwd=tmp_path)
    assert "mixed_precision bf16; config file ./torchbay.yaml (found in the working directory" in plan.stdout, \
        plan.stdout + plan.stderr
    ran = torchbay("launch", str(script), cwd=tmp_path)
    assert ran.returncode == 0 and "config file ./torchbay.yaml" in ran.stderr.splitlines()[0], ran.stderr
    shown = torchbay("config", "show", "--sources", cwd=tmp_path)
    assert '"bf16"  # config file torchbay.yaml' in shown.stdout, shown.stdout
    named = torchbay("launch", "--dry-run", "--config-file", os.devnull, str(script), cwd=tmp_path)
    assert "mixed_precision no" in named.stdout and "found in the working directory" not in named.stdout


# --- output that ends early, help that fits -----------------------------------------------------------

def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "torchbay.cli.main", "config", "show", "--sources"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # as `| head -0` does: gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipeError" not in err, err


def test_estimate_memory_help_shows_only_what_it_reads():
    done = torchbay("estimate-memory", "--help")
    assert done.returncode == 0
    assert "--num-processes" in done.stdout and "--set" in done.stdout
    for unused in ("--mixed-precision", "--dataloader-even-batches", "--checkpoint-io", "--fp8-recipe", "--log-with"):
        assert unused not in done.stdout, unused
    assert len(done.stdout.splitlines()) < 80


# --- torchbay env: short enough to paste ---------------------------------------------------------------

def test_env_starts_with_python_torch_torchbay_and_plugins_and_says_each_thing_once(tmp_path):
    done = torchbay("env", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["```", "torchbay env", ""]
    assert [line.split(":")[0] for line in lines[3:8]] == ["python", "torch", "torchbay", "libraries", "plugins"]
    unavailable = [line.split(": not available: ", 1)[1] for line in lines if ": not available: " in line]
    assert all(done.stdout.count(reason) == 1 for reason in unavailable), done.stdout  # each device once
    assert len(lines) <= 50, f"{len(lines)} lines:\n{done.stdout}"  # was 81 with every plugin here installed


# --- the README's first screen ----------------------------------------------------------------------

def test_the_readme_first_screen_has_the_gpu_set_up_and_the_two_guides():
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:50])
    for needle in ("CUDA or ROCm build of torch", "pip install\ntorchbay torchbay-cuda", "torchbay env",
                   "(accelerator: cuda)", "cuda: 8 found", "docs/accelerate-compat.md", "docs/fault-tolerance.md"):
        assert needle in first_screen, needle
    for linked in ("docs/accelerate-compat.md", "docs/fault-tolerance.md"):
        assert (ROOT / linked).is_file()
    assert "torchbay-cuda" in _in_tree_distributions()  # the distribution it names is published here


# --- issue 36: an Accelerate config given to torchbay launch, a table that fits the terminal ----------------------

def test_launch_reads_an_accelerate_config_file_through_the_import(tmp_path, script):
    # Accelerate's file for several CPU processes, as `accelerate config` writes it (keys torchbay has no use for
    # included): it runs on this machine, so the dry run shows the plan it gives
    accelerate_file = tmp_path / "accelerate_cpu.yaml"
    accelerate_file.write_text("compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: MULTI_CPU\n"
                               "downcast_bf16: 'no'\nenable_cpu_affinity: false\nmachine_rank: 0\n"
                               "main_training_function: main\nmixed_precision: 'no'\nnum_machines: 1\n"
                               "num_processes: 3\nrdzv_backend: static\nsame_network: true\ntpu_env: []\n"
                               "tpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: true\n")
    done = torchbay("launch", "--config_file", str(accelerate_file), "--dry-run", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "torchbay config import-accelerate" in done.stderr and len(done.stderr) < 1500, done.stderr
    assert "num_processes = 3" in done.stdout, done.stdout
    assert accelerate_file.read_text().startswith("compute_environment: LOCAL_MACHINE")  # the user's file is only read
    assert not list(tmp_path.glob("torchbay-from-accelerate-*"))


def test_plugins_table_fits_the_terminal(tmp_path):
    done = torchbay("plugins", cwd=tmp_path, env={"COLUMNS": "140"})
    assert done.returncode == 0 and max(len(line) for line in done.stdout.splitlines()) <= 140, done.stdout


def test_readme_says_to_activate_the_venv():
    assert "source .venv/bin/activate" in (ROOT / "README.md").read_text()
