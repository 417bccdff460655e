"""torchbay-dvclive against the real DVCLive, read back with DVCLive's own readers
(dvclive.utils.parse_tsv, dvclive.serialize.load_yaml)."""

import json
import subprocess

import pytest
import torch

from torchbay import Accelerator
from torchbay.errors import ConfigError, IncompatibleSetupError
from torchbay.testing.tracking_run import CONFIG, expected_values

pytest.importorskip("dvclive")


def _number_or_text(cell):
    try:
        return float(cell)
    except ValueError:
        return cell


def read(run_dir):
    from dvclive.serialize import load_yaml
    from dvclive.utils import parse_tsv

    metrics = {}
    for tsv in sorted((run_dir / "plots" / "metrics").rglob("*.tsv")):
        name = tsv.relative_to(run_dir / "plots" / "metrics").with_suffix("").as_posix()
        leaf = name.rsplit("/", 1)[-1]
        metrics[name] = [(int(row["step"]), _number_or_text(row[leaf])) for row in parse_tsv(str(tsv))]
    return metrics, load_yaml(str(run_dir / "params.yaml"))


def test_metrics_params_and_end_training_writes_the_summary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside any Git repository: DVCLive sets up no DVC repository
    acc = Accelerator(project_dir=str(tmp_path), log_with="dvclive")
    acc.init_trackers("proj", config=CONFIG)
    for step in range(3):
        values = expected_values(step)
        acc.log({"loss": torch.tensor(values["loss"]), "acc": values["acc"], "nested": {"count": step},
                 "note": f"step {step}", "tags": ["a", step]})
    tracker = acc.get_tracker("dvclive")
    assert tracker.tracker is acc.get_tracker("dvclive", unwrap=True) is not None
    acc.end_training()
    assert tracker._ended and acc.trackers == [tracker]  # Live.end() called; kept to read back, as in Accelerate
    run_dir = tmp_path / "logs" / "dvclive" / "proj"
    metrics, params = read(run_dir)
    note = metrics.pop("note")  # a string is a DVCLive metric, as under Accelerate
    assert metrics == {name: [(s, expected_values(s)[name]) for s in range(3)]
                       for name in ("acc", "loss", "nested/count")}
    assert note == [(s, f"step {s}") for s in range(3)]
    # numpy ints and tensors converted (DVCLive cannot store a numpy int), nesting kept
    assert params == {"lr": 0.1, "model": {"width": 4, "depth": 2}, "seed": 7, "name": "tiny"}
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["loss"] == 2.0 and summary["nested"]["count"] == 2 and summary["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # nothing outside its dir
    assert (run_dir / "text" / "tags.tsv").read_text().splitlines() == ["step\tvalue", '0\t["a", 0]', '1\t["a", 1]',
                                                                       '2\t["a", 2]']  # DVCLive refuses a list


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


def _git_repository_with_a_commit(path):
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "start"], check=True)  # (DVCLive fails on none)
    (path / "train").mkdir()


def test_in_a_git_repository_without_dvc_the_run_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    _git_repository_with_a_commit(tmp_path)
    monkeypatch.chdir(tmp_path / "train")
    with pytest.raises(IncompatibleSetupError) as refused:
        Accelerator(project_dir=str(tmp_path / "train"), log_with="dvclive")
    assert f"DVCLive would run `dvc init` in the Git repository {tmp_path}" in str(refused.value)
    assert "dvclive.dvc_init: true" in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".git", "train"]  # nothing written
    index = subprocess.run(["git", "-C", str(tmp_path), "status", "--porcelain"], capture_output=True, text=True)
    assert index.stdout == ""  # nothing staged


def test_with_dvc_init_allowed_dvclive_sets_dvc_up_as_it_does_alone(tmp_path, monkeypatch, capsys, caplog):
    _git_repository_with_a_commit(tmp_path)
    monkeypatch.chdir(tmp_path / "train")
    acc = Accelerator(project_dir=str(tmp_path / "train"), log_with="dvclive", config={"dvclive": {"dvc_init": True}})
    acc.init_trackers("proj", config=CONFIG)
    acc.log({"loss": 1.0})
    acc.end_training()
    # told on stderr, or through the `torchbay` logger when the process has set logging up (tracking.say)
    told = capsys.readouterr().err + caplog.text
    assert f"DVCLive runs `dvc init` in the Git repository {tmp_path}" in told
    assert (tmp_path / ".dvc").is_dir() and (tmp_path / ".dvcignore").exists()  # DVCLive's own set-up, as allowed
    assert (tmp_path / "train" / "logs" / "dvclive" / "proj" / "metrics.json").exists()


def test_inside_a_dvc_repository_nothing_is_said(tmp_path, monkeypatch, capsys):
    from torchbay_dvclive.tracker import git_root_dvclive_sets_up

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert git_root_dvclive_sets_up(tmp_path / "a" / "b") == tmp_path
    (tmp_path / ".dvc").mkdir()
    assert git_root_dvclive_sets_up(tmp_path / "a" / "b") is None


def test_telemetry_reaches_dvclive_with_its_names_and_steps(tmp_path, monkeypatch):
    from torchbay.testing import telemetry_run

    monkeypatch.chdir(tmp_path)  # outside any Git repository
    telemetry_run.train(str(tmp_path), "dvclive")
    metrics, _ = read(tmp_path / "logs" / "dvclive" / "telemetry")
    for name in telemetry_run.FIRST_STEP:
        assert 1 in [step for step, _ in metrics[name]], name
    for name in telemetry_run.WINDOW:
        assert 3 in [step for step, _ in metrics[name]], name
    assert "throughput/mfu" not in metrics
