"""torchbay-trackio against the real Trackio (local store), read back with Trackio's own API
(trackio.api.Api, trackio's SQLiteStorage.get_logs). Trackio fixes its store directory when it
is imported, so each run and each read is a process of its own."""

import json
import subprocess
import sys
import textwrap

import pytest

from torchbay.testing.processes import run_python
from torchbay.testing.tracking_run import expected_values

pytest.importorskip("trackio")

READ = """
import json, sys
from trackio.api import Api
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
runs = [{"name": r.name, "config": {k: v for k, v in (r.config or {}).items() if not k.startswith("_")},
         "logs": SQLiteStorage.get_logs(project, r.name)} for r in Api().runs(project)]
print(json.dumps(runs, default=str))
"""


def read(store, project):
    proc = subprocess.run([sys.executable, "-c", READ, project], capture_output=True, text=True, timeout=120,
                          env={"TRACKIO_DIR": str(store), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def series(run, key):
    return [(row["step"], row[key]) for row in run["logs"] if key in row]


CONFIG = {"lr": 0.1, "model": {"width": 4, "depth": 2}, "seed": 7, "name": "tiny"}


def test_logs_config_and_end_training_finishes_the_run(tmp_path):
    script = tmp_path / "one.py"
    script.write_text(textwrap.dedent(f"""
        import json, numpy as np, torch
        from torchbay import Accelerator
        from torchbay.testing.tracking_run import CONFIG, expected_values
        acc = Accelerator(project_dir={str(tmp_path)!r}, log_with="trackio")
        acc.init_trackers("proj", config=CONFIG, init_kwargs={{"trackio": {{"name": "first"}}}})
        for step in range(3):
            v = expected_values(step)
            acc.log({{"loss": torch.tensor(v["loss"]), "acc": np.float32(v["acc"]), "nested": {{"count": step}},
                     "note": f"step {{step}}"}})
        tracker = acc.get_tracker("trackio")
        location = tracker.location
        acc.end_training()
        from trackio import context_vars
        print(json.dumps({{"location": location,
                           "closed": tracker.run is None and context_vars.current_run.get() is None}}))
    """))
    result = run_python(str(script), env={"HF_HUB_OFFLINE": "1"}, timeout=180).check()
    out = json.loads(result.stdout.strip().splitlines()[-1])
    store = tmp_path / "logs" / "trackio"
    assert out == {"location": str(store / "proj.db"), "closed": True}
    (run,) = read(store, "proj")
    assert run["name"] == "first" and run["config"] == CONFIG  # tensors and numpy values converted
    for key in ("loss", "acc", "nested/count"):  # Trackio itself drops tensor values
        assert series(run, key) == [(s, expected_values(s)[key]) for s in range(3)]
    assert series(run, "note") == [(s, f"step {s}") for s in range(3)]


def test_two_processes_with_jsonl_and_resume(launches, tmp_path):
    results = launches("trackio,jsonl", env={"HF_HUB_OFFLINE": "1"})
    assert results[0]["trackers"] == ["trackio", "jsonl"] and results[1]["trackers"] == []
    runs = read(tmp_path / "logs" / "trackio", "tiny")
    assert len(runs) == 2 and all(run["config"] == CONFIG for run in runs)  # one run per launch, rank 0 only
    steps = sorted(series(runs[0], "loss") + series(runs[1], "loss"))
    assert steps == [(s, expected_values(s)["loss"]) for s in range(6)]


def test_bad_settings_are_refused(tmp_path):
    from torchbay import Accelerator
    from torchbay.errors import ConfigError

    with pytest.raises(ConfigError, match="trackio.server_url"):
        Accelerator(project_dir=str(tmp_path), log_with="trackio", config={"trackio": {"server_url": "ftp://x"}})


def test_telemetry_reaches_trackio_with_its_names_and_steps(tmp_path):
    from torchbay.testing import telemetry_run

    run_python(telemetry_run.__file__, ["--project-dir", str(tmp_path), "--log-with", "trackio"],
               env={"HF_HUB_OFFLINE": "1"}, timeout=180).check()
    (run,) = read(tmp_path / "logs" / "trackio", "telemetry")
    for name in telemetry_run.FIRST_STEP:
        assert 1 in [step for step, _ in series(run, name)], name
    for name in telemetry_run.WINDOW:
        assert 3 in [step for step, _ in series(run, name)], name
    assert not series(run, "throughput/mfu")
