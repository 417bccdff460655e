"""Experiment trackers (docs/tracking.md): the registration hook, selection by name, the built-in
jsonl tracker, Accelerate's API (log_with, init_trackers, log, get_tracker, end_training),
step numbers across save/load_state, errors before training, and `torchbay plot`."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from torchbay import Accelerator
from torchbay.errors import ConfigError
from torchbay.registry.manager import PluginManager, hookimpl, reset_plugin_manager
from torchbay.testing import tracking_run
from torchbay.testing.processes import run_torchrun
from torchbay.tracking.jsonl import JSONLinesTracker, read_jsonl, read_scalars
from torchbay.tracking.trackers import GeneralTracker, LoggerType, TrackerError
from torchbay.tracking.values import flatten, to_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MemorySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    logging_dir: str | None = None
    flavour: str = "plain"


class MemoryTracker(GeneralTracker):
    """A stand-in tracker plugin: keeps everything in lists."""

    name = "memory"
    requires_logging_directory = True
    created: list = []

    def __init__(self, run_name, logging_dir=None, settings=None, **kwargs):
        super().__init__()
        self.run_name, self.dir, self.settings, self.kwargs = run_name, logging_dir, settings, kwargs
        self.config, self.logged, self.finished, self.started = None, [], False, False
        MemoryTracker.created.append(self)

    @classmethod
    def check(cls, context):
        flavour = context.config.memory.flavour
        return [] if flavour in ("plain", "salty") else [f"memory.flavour '{flavour}': use plain or salty"]

    def start(self):
        self.started = True

    @property
    def tracker(self):
        return self.logged

    @property
    def location(self):
        return str(self.dir)

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, values, kwargs))

    def finish(self):
        self.finished = True


class MemoryPlugin:
    @hookimpl
    def torchbay_register_trackers(self):
        return [MemoryTracker]

    @hookimpl
    def torchbay_config_sections(self):
        return {"memory": MemorySettings}


@pytest.fixture
def memory_pm():
    pm = PluginManager(autoload=False)
    pm.register_plugin(MemoryPlugin(), "memory")
    reset_plugin_manager(pm)
    MemoryTracker.created.clear()
    return pm


def test_a_plugin_registers_a_tracker_and_its_section(memory_pm, tmp_path):
    assert set(memory_pm.registries()["trackers"]) == {"jsonl", "memory"}
    assert "tracker:memory" in memory_pm.infos["memory"].registers
    acc = Accelerator(project_dir=str(tmp_path), log_with="memory", config={"memory": {"flavour": "salty"}})
    acc.init_trackers("run", config={"a": {"b": 1}}, init_kwargs={"memory": {"colour": "red"}})
    (tracker,) = MemoryTracker.created
    assert tracker.started and tracker.run_name == "run" and tracker.kwargs == {"colour": "red"}
    assert tracker.settings.flavour == "salty" and tracker.config == {"a": {"b": 1}}
    assert tracker.dir == tmp_path / "logs" / "memory"  # every tracker under the run's project dir by default
    acc.log({"x": 1}, log_kwargs={"memory": {"commit": True}})
    acc.log({"x": 2}, step=10)
    acc.log({"x": 3})
    assert [s for s, _, _ in tracker.logged] == [0, 10, 11]  # no step: the one after the last
    assert tracker.logged[0][2] == {"commit": True}
    assert acc.get_tracker("memory") is tracker and acc.get_tracker("memory", unwrap=True) is tracker.logged
    with pytest.raises(TrackerError, match="not a tracker of this run"):
        acc.get_tracker("jsonl")
    acc.end_training()
    assert tracker.finished and acc.trackers == [tracker]  # finished trackers stay readable, as in Accelerate
    acc.end_training()  # finishes them once


def test_the_accelerator_holds_the_runs_trackers_and_hands_its_methods_over(memory_pm, tmp_path):
    """issue 37 item 4: the trackers are a RunTracking the Accelerator holds, not fields of a mixin."""
    from torchbay.tracking.run import RunTracking

    acc = Accelerator(project_dir=str(tmp_path), log_with="memory")
    tracking = acc.tracking
    assert isinstance(tracking, RunTracking) and tracking.phase == "new" and acc.log_with == ["memory"]
    assert tracking.counters is acc.training_state  # the step log uses is the one save_state saves
    acc.init_trackers("run")
    acc.log({"x": 1}, step=4)
    assert tracking.phase == "started" and acc.trackers == tracking.running == MemoryTracker.created
    assert acc.tracker_step == tracking.counters.tracker_step == 5
    assert acc.get_tracker("memory") is tracking.get("memory", main=True)
    acc.end_training()
    assert tracking.phase == "finished" and MemoryTracker.created[0].finished
    assert not any(name.startswith("_tracker") for name in vars(acc))  # no tracker state left on the Accelerator


def test_a_tracker_section_sets_its_own_logging_dir(memory_pm, tmp_path):
    own = tmp_path / "elsewhere"
    acc = Accelerator(project_dir=str(tmp_path), log_with="memory", config={"memory": {"logging_dir": str(own)}})
    acc.init_trackers("run")
    assert MemoryTracker.created[0].dir == own
    acc.end_training()


def test_tracking_logging_dir_moves_every_tracker(memory_pm, tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with=["memory", "jsonl"],
                      config={"tracking": {"logging_dir": str(tmp_path / "L")}})
    acc.init_trackers("run")
    assert MemoryTracker.created[0].dir == tmp_path / "L" / "memory"
    assert acc.get_tracker("jsonl").location == str(tmp_path / "L" / "jsonl" / "run" / "metrics.jsonl")
    acc.end_training()


def test_all_selects_every_installed_tracker(memory_pm, tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with=LoggerType.ALL)
    acc.init_trackers("run")
    assert sorted(t.name for t in acc.trackers) == ["jsonl", "memory"]
    acc.end_training()


def test_a_tracker_instance_in_log_with(tmp_path):
    class Mine(GeneralTracker):
        name = "mine"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.logged = []

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, values))

    mine = Mine()
    acc = Accelerator(project_dir=str(tmp_path), log_with=[mine, "jsonl"])
    acc.init_trackers("run", init_kwargs={"mine": {}})
    acc.log({"loss": torch.tensor(0.5)})
    assert mine.logged == [(0, {"loss": torch.tensor(0.5)})]
    assert [t.name for t in acc.trackers] == ["jsonl", "mine"]
    acc.end_training()


def test_the_jsonl_tracker_converts_and_reads_back(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with="jsonl")
    acc.init_trackers("run", config={"opt": {"lr": torch.tensor(0.5)}, "n": np.int64(3), "path": tmp_path})
    acc.log({"loss": torch.tensor(2.0), "acc": np.float32(0.25), "nested": {"k": np.int64(4)}, "text": "hi",
             "bad": float("nan")})
    acc.log({"loss": torch.tensor(1.0)})
    path = tmp_path / "logs" / "jsonl" / "run" / "metrics.jsonl"
    assert acc.get_tracker("jsonl").location == str(path)
    acc.end_training()
    records = read_jsonl(path)
    assert records[1]["config"] == {"opt": {"lr": 0.5}, "n": 3, "path": str(tmp_path)}
    assert records[2]["values"] == {"loss": 2.0, "acc": 0.25, "nested": {"k": 4}, "text": "hi", "bad": "nan"}
    assert records[-1]["event"] == "finish"
    assert read_scalars(path) == {"loss": [(0, 2.0), (1, 1.0)], "acc": [(0, 0.25)], "nested/k": [(0, 4.0)]}


def test_the_jsonl_tracker_never_writes_into_a_file_it_did_not_write(tmp_path):
    path = tmp_path / "logs" / "jsonl" / "run" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("precious\n")
    acc = Accelerator(project_dir=str(tmp_path), log_with="jsonl")
    with pytest.raises(TrackerError, match="not written by torchbay"):
        acc.init_trackers("run")
    assert path.read_text() == "precious\n"
    acc.end_training()


def test_values_are_converted_for_backends():
    assert to_python({"a": torch.tensor([1, 2]), "b": np.float64(0.5), "c": torch.tensor(True)}) == \
        {"a": [1, 2], "b": 0.5, "c": True}
    assert type(to_python(np.float64(0.5))) is float and type(to_python(np.int32(2))) is int
    assert flatten({"a": {"b": {"c": torch.tensor(1.5)}}, "d": 1}) == {"a/b/c": 1.5, "d": 1}


def test_logger_type():
    assert LoggerType.JSONL == "jsonl" and LoggerType.JSONL.value == "jsonl" and LoggerType.ALL.name == "ALL"
    assert "jsonl" in [str(t) for t in LoggerType]
    from torchbay.utils import LoggerType as FromUtils

    assert FromUtils is LoggerType
    with pytest.raises(TrackerError, match=r"not installed .*no plugin torchbay publishes provides tracker 'nosuch'"):
        LoggerType.NOSUCH


# --- errors: before training, naming the fix ---------------------------------------------------


def test_a_tracker_that_is_not_installed_fails_at_construction_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        Accelerator(project_dir=str(tmp_path), log_with=["jsonl", "nosuch_tracker"])
    message = str(info.value)
    assert "\n" not in message and "tracking.log_with" in message
    assert "tracker 'nosuch_tracker' is not installed" in message and "pip install" not in message


def test_bad_tracking_values(tmp_path):
    with pytest.raises(ConfigError, match="not a tracker name"):
        Accelerator(project_dir=str(tmp_path), log_with="Tensor Board")
    with pytest.raises(TrackerError, match="not a tracker name, LoggerType or GeneralTracker instance"):
        Accelerator(project_dir=str(tmp_path), log_with=[JSONLinesTracker])  # a class, not an instance
    with pytest.raises(ConfigError, match="tracking.log_with"):
        Accelerator(project_dir=str(tmp_path), config={"tracking": {"log_with": 5}})
    with pytest.raises(ConfigError, match="unknown key 'tracking.log_dir'"):
        Accelerator(project_dir=str(tmp_path), config={"tracking": {"log_dir": "x"}})
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        Accelerator(project_dir=str(tmp_path), log_with="jsonl",
                    config={"tracking.logging_dir": str(tmp_path / "afile")})


def test_a_selected_trackers_own_check_is_reported_with_the_rest(memory_pm, tmp_path):
    with pytest.raises(ConfigError, match="memory.flavour 'sweet': use plain or salty"):
        Accelerator(project_dir=str(tmp_path), log_with="memory", config={"memory": {"flavour": "sweet"}})
    Accelerator(project_dir=str(tmp_path), log_with="jsonl", config={"memory": {"flavour": "sweet"}}).end_training()


def test_calls_in_the_wrong_order(memory_pm, tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with="memory")
    with pytest.raises(TrackerError, match="init_trackers.* was not called"):
        acc.log({"x": 1})
    with pytest.raises(TrackerError, match="does not log to"):
        acc.init_trackers("run", init_kwargs={"wrong_name": {}})
    with pytest.raises(TrackerError, match="without '/'"):
        acc.init_trackers("a/b")
    acc.init_trackers("run")
    with pytest.raises(TrackerError, match="already called"):
        acc.init_trackers("run")
    with pytest.raises(TrackerError, match="step must be"):
        acc.log({"x": 1}, step=-1)
    acc.end_training()
    with pytest.raises(TrackerError, match="end_training"):
        acc.log({"x": 1})


def test_without_trackers_log_does_nothing(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path))
    acc.init_trackers("run")
    acc.log({"x": 1})
    assert acc.trackers == [] and not (tmp_path / "logs").exists()
    acc.end_training()


def test_the_launch_flag_and_env_select_trackers(capsys, tmp_path, monkeypatch):
    from torchbay.cli.main import main

    assert main(["config", "show", "--log-with", "jsonl", "--log-with", "a,b", "--sources"]) == 0
    out = capsys.readouterr().out
    assert re.search(r'tracking.log_with\s+= \["jsonl", "a", "b"\]\s+# command line --log-with', out)
    monkeypatch.setenv("TORCHBAY_TRACKING__LOG_WITH", "jsonl")
    monkeypatch.setenv("TORCHBAY_PROJECT__PROJECT_DIR", str(tmp_path))
    assert main(["env", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"name": "jsonl", "plugin": "tracking", "available": True} in report["trackers"]
    assert report["tracking"] == {"jsonl": str(tmp_path / "logs" / "jsonl")}


def test_launch_refuses_a_tracker_that_is_not_installed_before_starting_processes(tmp_path):
    marker = tmp_path / "started"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = subprocess.run([sys.executable, "-m", "torchbay.cli.main", "launch", "--num-processes", "2", "--log-with",
                           "nosuch", str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "tracker 'nosuch' is not installed" in proc.stderr
    assert "no plugin torchbay publishes provides tracker 'nosuch'" in proc.stderr and not marker.exists()


def test_the_questionnaire_asks_only_about_installed_trackers(memory_pm, capsys, tmp_path, monkeypatch):
    import yaml

    from torchbay.cli.main import main

    answers = {"Log metrics": "memory", "memory.flavour": "salty"}
    prompts = []

    def fake_input(prompt):
        prompts.append(prompt)
        return next((a for start, a in answers.items() if prompt.startswith(start)), "")

    monkeypatch.setattr("builtins.input", fake_input)
    assert main(["config", "-o", str(tmp_path / "c.yaml")]) == 0
    tree = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert tree["tracking"] == {"log_with": ["memory"]} and tree["memory"] == {"flavour": "salty"}
    question = next(p for p in prompts if p.startswith("Log metrics"))
    assert "installed: jsonl, memory)" in question


# --- resume and processes ----------------------------------------------------------------------


def test_step_numbers_continue_after_load_state(memory_pm, tmp_path):
    def run(resume):
        acc = Accelerator(project_dir=str(tmp_path), log_with="memory")
        model = acc.prepare(torch.nn.Linear(2, 2))
        acc.init_trackers("run")
        if resume:
            acc.load_state(str(tmp_path / "ck"))
        for _ in range(3):
            acc.log({"w": model.weight.sum()})
        acc.save_state(str(tmp_path / "ck"))
        steps = [s for s, _, _ in acc.get_tracker("memory").logged]
        acc.end_training()
        return steps

    assert run(False) == [0, 1, 2]
    assert run(True) == [3, 4, 5]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_only_rank_0_writes_and_steps_continue_after_resume(tmp_path):
    args = ["--project-dir", str(tmp_path), "--log-with", "jsonl"]
    run_torchrun(tracking_run.__file__, 2, args, timeout=240).check()
    run_torchrun(tracking_run.__file__, 2, [*args, "--resume"], timeout=240).check()
    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["trackers"] == ["jsonl"] and results[1]["trackers"] == []
    assert [r["first_step"] for r in results] == [3, 3] and [r["tracker_step"] for r in results] == [6, 6]
    files = list(tmp_path.rglob("*.jsonl"))
    assert files == [tmp_path / "logs" / "jsonl" / "tiny" / "metrics.jsonl"]
    records = read_jsonl(files[0])
    assert [r["event"] for r in records if "event" in r] == ["finish", "finish"]  # closed by end_training
    assert sum("format" in r for r in records) == 2  # one start per launch, appended
    configs = [r["config"] for r in records if "config" in r]
    assert configs[0] == {"lr": 0.1, "model": {"width": 4, "depth": 2}, "seed": 7, "name": "tiny"}
    scalars = read_scalars(files[0])
    assert scalars["loss"] == [(s, tracking_run.expected_values(s)["loss"]) for s in range(6)]
    assert scalars["nested/count"] == [(s, float(s)) for s in range(6)]


# --- torchbay plot -----------------------------------------------------------------------------


def _metrics_file(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with="jsonl")
    acc.init_trackers("demo")
    for step in range(5):
        acc.log({"train/loss": 2.0 - 0.1 * step, "train/lr": 0.001})
    acc.log({"eval/loss": 1.7}, step=4)
    acc.end_training()


def test_plot_draws_the_scalars_to_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from torchbay.cli.main import main
    from torchbay.cli.plot import panels

    _metrics_file(tmp_path)
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in capsys.readouterr().out
    assert main(["plot", str(tmp_path)]) == 2  # never replaced without --force
    assert "--force" in capsys.readouterr().err
    assert main(["plot", str(tmp_path), "--force", "--metrics", "loss"]) == 2
    assert "not logged" in capsys.readouterr().err
    assert main(["plot", str(tmp_path), "--force", "--metrics", "train/loss,eval/loss"]) == 0
    assert panels({"train/loss": [], "eval/loss": [], "train/lr": []}) == \
        {"loss": ["train/loss", "eval/loss"], "lr": ["train/lr"]}


def test_plot_says_how_to_install_matplotlib(tmp_path, capsys, monkeypatch):
    from torchbay.cli.main import main

    _metrics_file(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install matplotlib" in err and "Traceback" not in err


def test_plot_of_a_directory_without_logs(tmp_path, capsys):
    from torchbay.cli.main import main

    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


# --- architecture ------------------------------------------------------------------------------

TRACKER_LIBRARIES = re.compile(r"\b(tensorboard|tensorboardx|mlflow|wandb|dvclive|trackio|aim)\b", re.IGNORECASE)


def test_the_core_names_no_tracker_library():
    """docs/architecture.md: the core knows the tracker interface and the built-in jsonl tracker only."""
    hits = []
    core = os.path.join(ROOT, "core", "torchbay")
    for folder, dirs, files in os.walk(core):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith((".pyc", ".so")):
                continue
            path = os.path.join(folder, name)
            if path.endswith(os.path.join("resources", "published_plugins.yaml")):
                continue  # the names of the distributions torchbay publishes, for install hints (test_architecture)
            if path.endswith(os.path.join("resources", "accelerate_surface.yaml")):
                continue  # Accelerate's own names (LoggerType's members...), data the compat switch serves
            for number, line in enumerate(open(path, encoding="utf-8"), 1):
                if TRACKER_LIBRARIES.search(line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not hits, "the core names a tracker library:\n" + "\n".join(hits)


def test_import_and_plugin_loading_import_no_tracker_library():
    code = ("import sys, torchbay; from torchbay.registry.manager import get_plugin_manager; "
            "pm = get_plugin_manager(); "
            "pm.registries(); pm.config_sections(); import torchbay.tracking.trackers; "
            "print(sorted(m for m in ('tensorboard', 'torch.utils.tensorboard', 'mlflow', 'wandb', 'dvclive', "
            "'trackio', 'aim', 'matplotlib') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"imported at plugin load: {proc.stdout}"
