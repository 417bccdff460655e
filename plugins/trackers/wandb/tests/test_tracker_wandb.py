"""torchbay-wandb against the real wandb in offline mode (no network), read back by decoding the
offline run file's records with wandb's own protobuf classes (torchbay_wandb.offline)."""

import time

import pytest
import torch

from torchbay import Accelerator
from torchbay.errors import ConfigError
from torchbay.testing.tracking_run import CONFIG, expected_values

pytest.importorskip("wandb")

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def offline_runs(root, settle_s: float = 10.0):
    """Every offline run under ``root``, oldest first. wandb's own service process writes the run
    file, and its last record (the exit) can reach the disk a moment after ``finish()`` returned:
    read again until every run has it, for up to ``settle_s`` seconds."""
    from torchbay_wandb.offline import read_run

    deadline = time.monotonic() + settle_s
    while True:
        files = sorted(root.rglob("run-*.wandb"), key=lambda p: p.parent.name)  # offline-run-<time>-<id>
        runs = [read_run(path) for path in files]
        if all(run["exited"] for run in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.1)


def series(run, key):
    return [(row["_step"], row[key]) for row in run["history"] if key in row]


def test_history_config_and_end_training_finishes_the_run(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with="wandb", config={"wandb": {"mode": "offline"}})
    acc.init_trackers("proj", config=CONFIG, init_kwargs={"wandb": {"tags": ["t1"]}})
    for step in range(3):
        values = expected_values(step)
        acc.log({"loss": torch.tensor(values["loss"]), "acc": values["acc"], "nested": {"count": step},
                 "note": f"step {step}"})
    run = acc.get_tracker("wandb", unwrap=True)
    location = acc.get_tracker("wandb").location
    acc.end_training()
    assert run._is_finished  # finished by end_training
    assert location.startswith(str(tmp_path / "logs" / "wandb" / "wandb" / "offline-run-"))
    (record,) = offline_runs(tmp_path / "logs" / "wandb")
    assert record["exited"] and record["project"] == "proj"
    assert record["config"] == {"lr": 0.1, "model": {"width": 4, "depth": 2}, "seed": 7, "name": "tiny"}
    for key in ("loss", "acc", "nested/count"):
        assert series(record, key) == [(s, expected_values(s)[key]) for s in range(3)]
    assert series(record, "note") == [(s, f"step {s}") for s in range(3)]


def test_two_processes_with_jsonl_and_resume(launches, tmp_path):
    results = launches("wandb,jsonl", env={**OFFLINE, "TORCHBAY_WANDB__MODE": "offline"})
    assert results[0]["trackers"] == ["wandb", "jsonl"] and results[1]["trackers"] == []
    runs = offline_runs(tmp_path / "logs" / "wandb")
    assert len(runs) == 2 and all(r["exited"] for r in runs)  # one run per launch, rank 0 only
    assert [series(r, "loss") for r in runs] == [[(s, expected_values(s)["loss"]) for s in range(3)],
                                                  [(s, expected_values(s)["loss"]) for s in range(3, 6)]]
    assert runs[1]["config"]["model"] == {"width": 4, "depth": 2}


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="wandb.mode"):
        Accelerator(project_dir=str(tmp_path), log_with="wandb", config={"wandb": {"mode": "offlin"}})
    acc = Accelerator(project_dir=str(tmp_path), log_with="wandb")
    with pytest.raises(Exception, match="wandb.logging_dir"):
        acc.init_trackers("p", init_kwargs={"wandb": {"dir": "/tmp"}})
    acc.end_training()


def test_telemetry_reaches_wandb_with_its_names_and_steps(tmp_path):
    from torchbay.testing import telemetry_run

    telemetry_run.train(str(tmp_path), "wandb", config={"wandb": {"mode": "offline"}})
    (record,) = offline_runs(tmp_path / "logs" / "wandb")
    for name in telemetry_run.FIRST_STEP:
        assert 1 in [step for step, _ in series(record, name)], name
    for name in telemetry_run.WINDOW:
        assert 3 in [step for step, _ in series(record, name)], name
    assert not series(record, "throughput/mfu")
