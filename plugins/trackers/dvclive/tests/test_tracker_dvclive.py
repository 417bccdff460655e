"""torchbay-dvclive against the real DVCLive, read back with DVCLive's own readers
(dvclive.utils.parse_tsv, dvclive.serialize.load_yaml)."""

import json
import subprocess

import pytest
import torch

from torchbay import Accelerator
from torchbay.errors import ConfigError
from torchbay.tracking import TrackerError
from torchbay.testing.tracking_run import CONFIG, expected_values

pytest.importorskip("dvclive")


def read(run_dir):
    from dvclive.serialize import load_yaml
    from dvclive.utils import parse_tsv

    metrics = {}
    for tsv in sorted((run_dir / "plots" / "metrics").rglob("*.tsv")):
        name = tsv.relative_to(run_dir / "plots" / "metrics").with_suffix("").as_posix()
        leaf = name.rsplit("/", 1)[-1]
        metrics[name] = [(int(row["step"]), float(row[leaf])) for row in parse_tsv(str(tsv))]
    return metrics, load_yaml(str(run_dir / "params.yaml"))


def test_metrics_params_and_end_training_writes_the_summary(tmp_path, monkeypatch):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.chdir(tmp_path)  # inside a Git repository without DVC: DVCLive alone would `dvc init` it
    acc = Accelerator(project_dir=str(tmp_path), log_with="dvclive")
    acc.init_trackers("proj", config=CONFIG)
    for step in range(3):
        values = expected_values(step)
        acc.log({"loss": torch.tensor(values["loss"]), "acc": values["acc"], "nested": {"count": step},
                 "note": f"step {step}"})
    tracker = acc.get_tracker("dvclive")
    assert tracker.tracker is acc.get_tracker("dvclive", unwrap=True) is not None
    acc.end_training()
    assert tracker.live is None and acc.trackers == []  # Live.end() called and the tracker let go
    run_dir = tmp_path / "logs" / "dvclive" / "proj"
    metrics, params = read(run_dir)
    assert metrics == {name: [(s, expected_values(s)[name]) for s in range(3)] for name in ("acc", "loss", "nested/count")}
    # numpy ints and tensors converted (DVCLive cannot store a numpy int), nesting kept
    assert params == {"lr": 0.1, "model": {"width": 4, "depth": 2}, "seed": 7, "name": "tiny"}
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["loss"] == 2.0 and summary["nested"]["count"] == 2 and summary["step"] == 2
    assert not (tmp_path / ".dvc").exists() and not (tmp_path / ".dvcignore").exists()  # nothing outside its dir
    assert (run_dir / "text" / "note.tsv").read_text().splitlines() == ["step\tvalue", '0\t"step 0"', '1\t"step 1"',
                                                                       '2\t"step 2"']


def test_two_processes_with_jsonl_and_resume(launches, tmp_path):
    results = launches("jsonl,dvclive")
    assert results[0]["trackers"] == ["jsonl", "dvclive"] and results[1]["trackers"] == []
    metrics, params = read(tmp_path / "logs" / "dvclive" / "tiny")
    assert metrics["loss"] == [(s, expected_values(s)["loss"]) for s in range(6)]  # resumed: appended, steps go on
    assert params["model"] == {"width": 4, "depth": 2}
    assert [p.name for p in (tmp_path / "logs" / "dvclive").iterdir()] == ["tiny"]


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="dvclive.save_dvc_exp"):
        Accelerator(project_dir=str(tmp_path), log_with="dvclive", config={"dvclive": {"save_dvc_exp": "maybe"}})


def test_a_dvclive_without_the_replaced_set_up_is_refused_before_it_touches_the_repository(tmp_path, monkeypatch):
    import dvclive

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delattr(dvclive.Live, "_init_dvc")  # as a DVCLive release that renamed it would look
    acc = Accelerator(project_dir=str(tmp_path), log_with="dvclive")
    with pytest.raises(TrackerError, match=r"(?s)no Live\._init_dvc.*dvclive\.save_dvc_exp: true"):
        acc.init_trackers("proj", config=CONFIG)
    acc.end_training()
    assert not (tmp_path / ".dvc").exists() and not (tmp_path / "logs" / "dvclive" / "proj").exists()
