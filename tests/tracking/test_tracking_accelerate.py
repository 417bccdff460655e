"""Trackers as Accelerate's API has them, each call made on Accelerate and on torchbay side by side: a user's own
GeneralTracker instance (started by init_trackers), register_tracker_class and LOGGER_TYPE_TO_CLASS, the tracker
classes by Accelerate's names, and MLflow's own environment variables (MLFLOW_TRACKING_URI, MLFLOW_NESTED_RUN...)."""

import csv
import os

import pytest

import torchbay
import torchbay.tracking as tb_tracking
from torchbay.errors import TorchbayError

accelerate = pytest.importorskip("accelerate", reason="Accelerate (a dev dependency) is the reference")
import accelerate.tracking as acc_tracking  # noqa: E402
from accelerate.state import PartialState as AcceleratePartialState  # noqa: E402

SIDES = {"accelerate": (accelerate, acc_tracking), "torchbay": (torchbay, tb_tracking)}


@pytest.fixture
def fresh_state():
    """Each side's Accelerator starts from an empty process state (they share none)."""
    AcceleratePartialState._reset_state()
    torchbay.PartialState._reset_state()
    yield
    AcceleratePartialState._reset_state()
    torchbay.PartialState._reset_state()


def csv_tracker(base):
    """Accelerate's test tracker shape: the file is opened in start(), which only init_trackers calls."""

    class CSVTracker(base):
        name = "csv_tracker"
        requires_logging_directory = False

        def __init__(self, folder):
            super().__init__()
            self.folder, self.file, self.writer = folder, None, None

        def start(self):
            self.file = open(os.path.join(self.folder, "log.csv"), "w", newline="")
            self.writer = csv.DictWriter(self.file, fieldnames=["lr", "loss"])
            self.writer.writeheader()

        @property
        def tracker(self):
            return self.writer

        def store_init_configuration(self, values):
            self.writer.writerow(values)

        def log(self, values, step=None, **kwargs):
            self.writer.writerow(values)

        def finish(self):
            self.file.close()

    return CSVTracker


@pytest.mark.parametrize("side", SIDES)
def test_a_users_tracker_instance_is_started_by_init_trackers(tmp_path, fresh_state, side):
    library, tracking = SIDES[side]
    tracker = csv_tracker(tracking.GeneralTracker)(str(tmp_path))
    accelerator = library.Accelerator(log_with=tracker)
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.log({"loss": 0.5}, step=0)
    accelerator.end_training()
    with open(tmp_path / "log.csv") as f:
        assert list(csv.DictReader(f)) == [{"lr": "0.1", "loss": ""}, {"lr": "", "loss": "0.5"}]


def registered_tracker(base, requires_dir):
    class Registered(base):
        name = "registered_for_test"
        requires_logging_directory = requires_dir

        def __init__(self, run_name, logging_dir=None, **kwargs):
            super().__init__()
            self.run_name, self.logging_dir, self.kwargs, self.values = run_name, logging_dir, kwargs, []

        @property
        def tracker(self):
            return self

        def log(self, values, step=None, **kwargs):
            self.values.append((step, values))

    return Registered


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("requires_dir", [False, True])
def test_register_tracker_class_makes_a_class_selectable_by_name(tmp_path, fresh_state, side, requires_dir):
    library, tracking = SIDES[side]
    before = dict(tracking.LOGGER_TYPE_TO_CLASS)
    cls = registered_tracker(tracking.GeneralTracker, requires_dir)
    try:
        tracking.register_tracker_class(cls)
        assert tracking.LOGGER_TYPE_TO_CLASS[cls.name] is cls
        if requires_dir:  # Accelerate's convention: such a class needs the project's logging directory
            with pytest.raises(ValueError, match="requires a `logging_dir`"):
                library.Accelerator(log_with=cls.name)
            library.PartialState._reset_state()
        accelerator = library.Accelerator(log_with=cls.name, project_dir=str(tmp_path))
        accelerator.init_trackers("proj", init_kwargs={cls.name: {"colour": "red"}})
        accelerator.log({"x": 1}, step=3)
        tracker = accelerator.get_tracker(cls.name)
        accelerator.end_training()
        assert isinstance(tracker, cls) and tracker.run_name == "proj" and tracker.kwargs == {"colour": "red"}
        assert tracker.values == [(3, {"x": 1})]
        assert tracker.logging_dir == (str(tmp_path) if requires_dir else None)
        with pytest.warns(UserWarning, match=cls.name):
            tracking.register_tracker_class(cls)
        with pytest.raises(ValueError):
            tracking.register_tracker_class(dict)
    finally:
        tracking.LOGGER_TYPE_TO_CLASS.clear()
        tracking.LOGGER_TYPE_TO_CLASS.update(before)
    assert cls.name not in tracking.LOGGER_TYPE_TO_CLASS


def test_the_tracker_classes_answer_to_accelerates_names():
    installed = torchbay.tracking.LOGGER_TYPE_TO_CLASS
    for name, attr in (("tensorboard", "TensorBoardTracker"), ("mlflow", "MLflowTracker"), ("wandb", "WandBTracker"),
                       ("dvclive", "DVCLiveTracker"), ("aim", "AimTracker"), ("trackio", "TrackioTracker")):
        if name in installed:
            assert getattr(tb_tracking, attr) is installed[name]
    with pytest.raises(AttributeError):
        tb_tracking.NoSuchTracker  # noqa: B018


def test_mlflow_reads_mlflows_own_environment_variables(monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed in this environment")
    for value, expected in (("False", False), ("off", False), ("0", False), ("true", True), ("1", True)):
        monkeypatch.setenv("MLFLOW_NESTED_RUN", value)
        for tracking in (acc_tracking, tb_tracking):
            assert tracking.MLflowTracker(experiment_name="e", logging_dir="x").nested_run is expected
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from_env")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "a"}')
    for tracking in (acc_tracking, tb_tracking):
        tracker = tracking.MLflowTracker(experiment_name="given", logging_dir="x")
        assert (tracker.experiment_name, tracker.tags) == ("from_env", {"team": "a"})


def test_mlflow_logs_to_mlflow_tracking_uri(tmp_path, monkeypatch, fresh_state):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed in this environment")
    store = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root for that store is ./mlruns
    accelerator = torchbay.Accelerator(log_with="mlflow", project_dir=str(tmp_path / "project"))
    accelerator.init_trackers("exp", config={"lr": 0.1})
    accelerator.log({"loss": 0.25}, step=2)
    run_id = accelerator.get_tracker("mlflow").active_run.info.run_id
    accelerator.end_training()
    run = mlflow.MlflowClient(tracking_uri=store).get_run(run_id)  # read back through MLflow's own API
    assert run.data.metrics == {"loss": 0.25} and run.data.params == {"lr": "0.1"}
    assert mlflow.get_run(run_id).info.status == "FINISHED"  # MLflow's default store is that URI, too
    assert not (tmp_path / "project" / "logs" / "mlflow" / "mlflow.db").exists()


@pytest.mark.parametrize("side", SIDES)
def test_a_tracker_built_by_accelerates_constructor_waits_for_the_accelerator(tmp_path, fresh_state, side):
    library, tracking = SIDES[side]
    if not hasattr(tracking, "TensorBoardTracker") or "tensorboard" not in tracking.LOGGER_TYPE_TO_CLASS:
        pytest.skip("the tensorboard tracker is not installed")
    tracker = tracking.TensorBoardTracker(run_name="tb", logging_dir=str(tmp_path))
    assert not library.PartialState._shared_state  # building it touched no process state
    accelerator = library.Accelerator(log_with=tracker)
    accelerator.init_trackers("tb")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    assert any((tmp_path / "tb").iterdir())
    with pytest.raises(TorchbayError if side == "torchbay" else Exception):
        library.Accelerator(log_with=object())
