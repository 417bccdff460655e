"""torchbay-tensorboard against the real TensorBoard, read back with TensorBoard's own EventAccumulator."""

import pytest
import torch

from torchbay import Accelerator
from torchbay.errors import ConfigError
from torchbay.testing.tracking_run import CONFIG, expected_values

pytest.importorskip("tensorboard")


def read(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags["scalars"]}
    hparams = {}
    try:
        content = events.PluginTagToContent("hparams")
    except KeyError:  # no init config logged
        content = {}
    for blob in content.values():
        data = plugin_data_pb2.HParamsPluginData.FromString(blob)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                hparams[key] = getattr(value, value.WhichOneof("kind"))
    from tensorboard.util import tensor_util

    texts = {tag.removesuffix("/text_summary"): [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
                                                 for e in events.Tensors(tag)] for tag in tags["tensors"]}
    return scalars, hparams, texts


def expected_scalars(steps):
    return {name: [(s, expected_values(s)[name]) for s in steps] for name in ("loss", "acc", "nested/count")}


def test_scalars_hparams_and_end_training_closes_the_writer(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with="tensorboard")
    acc.init_trackers("run", config=CONFIG)
    for step in range(3):
        values = expected_values(step)
        acc.log({"loss": torch.tensor(values["loss"]), "acc": values["acc"], "nested": {"count": step},
                 "note": f"step {step}"})
    writer = acc.get_tracker("tensorboard", unwrap=True)
    assert acc.get_tracker("tensorboard").location == str(tmp_path / "logs" / "tensorboard" / "run")
    acc.end_training()
    assert writer.file_writer is None  # closed by end_training
    scalars, hparams, texts = read(tmp_path / "logs" / "tensorboard" / "run")
    assert scalars == expected_scalars(range(3))
    # nested config flattened; the tensor and the numpy int are numbers (add_hparams raises on a nested dict)
    assert hparams == {"lr": 0.1, "model/width": 4.0, "model/depth": 2.0, "seed": 7.0, "name": "tiny"}
    assert texts["note"] == [(s, f"step {s}") for s in range(3)]
    assert '"width": 4' in texts["config"][0][1]  # the whole config, as JSON text


def test_two_processes_with_jsonl_and_resume(launches, tmp_path):
    results = launches("tensorboard,jsonl")
    assert results[0]["trackers"] == ["tensorboard", "jsonl"] and results[1]["trackers"] == []
    assert results[0]["first_step"] == 3
    logdir = tmp_path / "logs" / "tensorboard" / "tiny"
    scalars, hparams, _ = read(logdir)
    assert scalars == expected_scalars(range(6))  # steps continue after load_state
    assert hparams["model/width"] == 4.0
    assert len(list(tmp_path.rglob("events.out.tfevents.*"))) == 4  # one writer + hparams per launch, rank 0 only
    from torchbay.plugin import read_scalars

    assert read_scalars(tmp_path / "logs" / "jsonl" / "tiny" / "metrics.jsonl")["loss"] == scalars["loss"]


def test_bad_settings_are_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="tensorboard.flush_secs"):
        Accelerator(project_dir=str(tmp_path), log_with="tensorboard", config={"tensorboard": {"flush_secs": 0}})
    with pytest.raises(ConfigError, match="unknown key 'tensorboard.flush'"):
        Accelerator(project_dir=str(tmp_path), log_with="tensorboard", config={"tensorboard": {"flush": 1}})


def test_its_own_logging_dir(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), log_with="tensorboard",
                      config={"tensorboard": {"logging_dir": str(tmp_path / "tb")}})
    acc.init_trackers("r")
    acc.log({"x": 1.0})
    acc.end_training()
    assert read(tmp_path / "tb" / "r")[0] == {"x": [(0, 1.0)]}


def test_telemetry_reaches_tensorboard_with_its_names_and_steps(tmp_path):
    from torchbay.testing import telemetry_run

    telemetry_run.train(str(tmp_path), "tensorboard")
    scalars, _, _ = read(tmp_path / "logs" / "tensorboard" / "telemetry")
    for name in telemetry_run.FIRST_STEP:
        assert 1 in [step for step, _ in scalars[name]], name
    for name in telemetry_run.WINDOW:
        assert 3 in [step for step, _ in scalars[name]], name
    assert "throughput/mfu" not in scalars  # the cpu's peak is unknown: absent, not 0
