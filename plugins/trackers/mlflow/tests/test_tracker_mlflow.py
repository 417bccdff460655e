"""torchbay-mlflow against the real MLflow (sqlite and file stores), read back with MlflowClient."""

import os

import pytest
import torch

from torchbay import Accelerator
from torchbay.errors import ConfigError
from torchbay.testing.tracking_run import CONFIG, expected_values

pytest.importorskip("mlflow")

PARAMS = {"lr": "0.1", "model/width": "4", "model/depth": "2", "seed": "7", "name": "tiny"}


def runs_of(uri, experiment):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    return client, runs


def history(client, run, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_metrics_params_config_and_end_training_finishes_the_run(tmp_path, store):
    settings = {} if store == "sqlite" else {"mlflow": {"tracking_uri": (tmp_path / "mlruns").as_uri()}}
    acc = Accelerator(project_dir=str(tmp_path), log_with="mlflow", config=settings)
    acc.init_trackers("proj", config=CONFIG, init_kwargs={"mlflow": {"run_name": "first", "tags": {"k": "v"}}})
    for step in range(3):
        values = expected_values(step)
        acc.log({"loss": torch.tensor(values["loss"]), "acc": values["acc"], "nested": {"count": step},
                 "note": f"step {step}"})
    tracker = acc.get_tracker("mlflow")
    assert acc.get_tracker("mlflow", unwrap=True).info.status == "RUNNING"
    acc.end_training()
    uri = tracker.tracking_uri
    if store == "sqlite":
        assert uri == f"sqlite:///{tmp_path / 'logs' / 'mlflow' / 'mlflow.db'}"
    client, (run,) = runs_of(uri, "proj")
    assert run.info.status == "FINISHED" and run.info.run_name == "first" and run.data.tags["k"] == "v"
    for key in ("loss", "acc", "nested/count"):  # tensors and numpy values kept (Accelerate's drops tensors)
        assert history(client, run, key) == [(s, expected_values(s)[key]) for s in range(3)]
    assert run.data.params == PARAMS  # flattened, not the dict's string
    import mlflow.artifacts

    root = run.info.artifact_uri
    assert mlflow.artifacts.load_dict(f"{root}/config.json") == \
        {"lr": 0.1, "model": {"width": 4, "depth": 2}, "seed": 7, "name": "tiny"}
    assert mlflow.artifacts.load_text(f"{root}/note/step_00000002.txt") == "step 2"
    assert not os.path.exists("mlruns") and not os.path.exists("mlflow.db")  # nothing in the working directory


def test_two_processes_with_jsonl_and_resume(launches, tmp_path):
    results = launches("jsonl,mlflow", init_kwargs={"mlflow": {"tags": {"job": "t"}}})
    assert results[0]["trackers"] == ["jsonl", "mlflow"] and results[1]["trackers"] == []
    client, runs = runs_of(f"sqlite:///{tmp_path / 'logs' / 'mlflow' / 'mlflow.db'}", "tiny")
    assert len(runs) == 2  # one run per launch, both from rank 0
    assert [history(client, run, "loss") for run in runs] == [
        [(s, expected_values(s)["loss"]) for s in range(3)], [(s, expected_values(s)["loss"]) for s in range(3, 6)]]
    assert all(run.data.params == PARAMS and run.info.status == "FINISHED" for run in runs)


def test_bad_settings_are_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="mlflow.tracking_uri 'mlruns' is not a store URI"):
        Accelerator(project_dir=str(tmp_path), log_with="mlflow", config={"mlflow": {"tracking_uri": "mlruns"}})
    acc = Accelerator(project_dir=str(tmp_path), log_with="mlflow")
    with pytest.raises(Exception, match="takes run_name, tags, description, run_id and nested_run"):
        acc.init_trackers("p", init_kwargs={"mlflow": {"store": "x"}})
    acc.end_training()


def test_telemetry_reaches_mlflow_with_its_names_and_steps(tmp_path):
    from torchbay.testing import telemetry_run

    acc = telemetry_run.train(str(tmp_path), "mlflow")
    client, (run,) = runs_of(acc.get_tracker("mlflow").tracking_uri, "telemetry")
    for name in telemetry_run.FIRST_STEP:
        assert 1 in [step for step, _ in history(client, run, name)], name
    for name in telemetry_run.WINDOW:
        assert 3 in [step for step, _ in history(client, run, name)], name
    assert "throughput/mfu" not in run.data.metrics
