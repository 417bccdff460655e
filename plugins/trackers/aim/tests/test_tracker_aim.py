"""torchbay-aim against the real Aim (local repository), read back with Aim's own API (Repo,
its index manager, Run.metrics()). Aim's reader starts file-watching threads, so each read
is a process of its own."""

import json
import subprocess
import sys

import pytest
import torch

from torchbay import Accelerator
from torchbay.errors import ConfigError
from torchbay.testing.tracking_run import CONFIG, expected_values

pytest.importorskip("aim")

READ = """
import json, os, sys, time
from aim import Repo
from aim.sdk.index_manager import RepoIndexManager
repo = Repo.from_path(sys.argv[1])
index = RepoIndexManager.get_index_manager(repo)
runs = []
for run_hash in repo.list_all_runs():
    for attempt in range(20):  # what `aim up` does in the background: merge the run's chunks into the index
        index.index(run_hash)
        run = repo.get_run(run_hash)
        if run is not None:
            break
        time.sleep(0.25)
    metrics = {m.name: [(int(step), float(value[0])) for step, value in m.data.items()] for m in run.metrics()}
    runs.append({"experiment": run.experiment, "hparams": run.get("hparams"), "metrics": metrics,
                 "active": run.active, "start": run.creation_time})
print(json.dumps(sorted(runs, key=lambda r: r["start"])))
sys.stdout.flush()
os._exit(0)
"""


def read(repo):
    proc = subprocess.run([sys.executable, "-c", READ, str(repo)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    for run in runs:
        run["metrics"] = {name: [tuple(point) for point in points] for name, points in run["metrics"].items()}
    return runs


HPARAMS = {"lr": 0.1, "model": {"width": 4, "depth": 2}, "seed": 7, "name": "tiny"}


def test_metrics_hparams_and_end_training_closes_the_run(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with="aim")
    acc.init_trackers("proj", config=CONFIG)
    for step in range(3):
        values = expected_values(step)
        acc.log({"loss": torch.tensor(values["loss"]), "acc": values["acc"], "nested": {"count": step},
                 "note": f"step {step}"})
    tracker = acc.get_tracker("aim")
    acc.end_training()
    assert tracker.run is None
    (run,) = read(tmp_path / "logs" / "aim")
    assert run["experiment"] == "proj" and run["hparams"] == HPARAMS and run["active"] is False  # closed
    for key in ("loss", "acc", "nested/count"):
        assert run["metrics"][key] == [(s, expected_values(s)[key]) for s in range(3)]


def test_two_processes_with_jsonl_and_resume(launches, tmp_path):
    results = launches("jsonl,aim")
    assert results[0]["trackers"] == ["jsonl", "aim"] and results[1]["trackers"] == []
    runs = read(tmp_path / "logs" / "aim")
    assert len(runs) == 2 and all(r["hparams"] == HPARAMS for r in runs)  # one run per launch, rank 0 only
    assert [r["metrics"]["loss"] for r in runs] == [[(s, expected_values(s)["loss"]) for s in range(3)],
                                                    [(s, expected_values(s)["loss"]) for s in range(3, 6)]]


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="aim.system_tracking_interval"):
        Accelerator(project_dir=str(tmp_path), log_with="aim", config={"aim": {"system_tracking_interval": -1}})


def test_telemetry_reaches_aim_with_its_names_and_steps(tmp_path):
    from torchbay.testing import telemetry_run

    telemetry_run.train(str(tmp_path), "aim")
    (run,) = read(tmp_path / "logs" / "aim")
    for name in telemetry_run.FIRST_STEP:
        assert 1 in [step for step, _ in run["metrics"][name]], name
    for name in telemetry_run.WINDOW:
        assert 3 in [step for step, _ in run["metrics"][name]], name
    assert "throughput/mfu" not in run["metrics"]
