"""Big-model inference under transformers, peft and diffusers: torchbay answering ``import accelerate``
(``TORCHBAY_AS_ACCELERATE=1``) against the real Accelerate, on the same cases.

tests/scripts/hf_big_model_cases.py runs every case in a fresh process on each side (tiny models built
from configs and saved under tmp_path: nothing is downloaded). Each case must give the outputs of the
model without a device map on torchbay, and the same placements and offloaded modules as on
Accelerate. These libraries are not in the dev environment: `make compat-hf` runs this file in
.venv-hf; elsewhere it skips, naming the missing library.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (make compat-hf runs this in .venv-hf)")

CASES_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_big_model_cases.py"
TRANSFORMERS_CASES = ["auto", "sequential", "balanced", "explicit_map", "torch_bin_checkpoint_to_disk"]
OTHER_CASES = ["peft_lora_on_dispatched_model", "peft_from_pretrained_with_device_map",
               "diffusers_model_cpu_offload", "diffusers_sequential_cpu_offload"]
#: cases Accelerate 1.15 fails on this machine (torchbay must pass them): what its error says
ACCELERATE_FAILS = {
    # its post_forward re-wraps a cpu weight with type(param)(value, requires_grad=...) and the weight is a
    # plain tensor once brought to the cpu execution device: "new() received an invalid combination of arguments"
    "diffusers_sequential_cpu_offload": "TypeError",
}


def _has_real_accelerate() -> bool:
    env = {**os.environ, "TORCHBAY_AS_ACCELERATE": "0"}
    code = "import accelerate, sys; sys.exit('torchbay' in accelerate.__version__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``{"torchbay": {case: result}, "accelerate": {...} or None}``, both sides run at once."""
    sides = {"torchbay": "1"}
    if _has_real_accelerate():
        sides["accelerate"] = "0"
    running = {}
    for side, switch in sides.items():
        work = tmp_path_factory.mktemp(f"hf-{side}")
        env = {**os.environ, "TORCHBAY_AS_ACCELERATE": switch, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        out = work / "results.json"
        log = open(work / "log.txt", "w")
        running[side] = (subprocess.Popen([sys.executable, str(CASES_SCRIPT), str(work), str(out)], env=env,
                                          stdout=log, stderr=subprocess.STDOUT), out, work / "log.txt", log)
    found = {"accelerate": None}
    for side, (process, out, log_path, log) in running.items():
        process.wait(timeout=900)
        log.close()
        if not out.exists():
            pytest.fail(f"the {side} run of {CASES_SCRIPT.name} wrote no results:\n{log_path.read_text()[-4000:]}")
        data = json.loads(out.read_text())
        assert ("torchbay" in data["accelerate"]) == (side == "torchbay"), data["accelerate"]
        found[side] = data["cases"]
    return found


def _ours(results, case):
    result = results["torchbay"][case]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert "error" not in result, result.get("traceback", result["error"])
    return result


def _comparable(result):
    return {k: v for k, v in result.items() if k not in ("traceback",)}


def _same_as_accelerate(results, case, ours):
    theirs = results["accelerate"]
    if theirs is None:
        return  # no real Accelerate installed: the equalities with the undispatched model still hold
    theirs = theirs[case]
    if case in ACCELERATE_FAILS:
        assert ACCELERATE_FAILS[case] in theirs.get("error", ""), \
            f"Accelerate passes {case} now: move it out of ACCELERATE_FAILS and compare ({theirs})"
        return
    assert "error" not in theirs, theirs.get("traceback")
    assert _comparable(ours) == _comparable(theirs)


@pytest.mark.parametrize("case", TRANSFORMERS_CASES)
def test_from_pretrained_with_a_device_map(results, case):
    ours = _ours(results, case)
    assert ours["logits_equal"] and ours["generate_equal"], ours
    assert "disk" in ours["device_map"].values() and ours["offloaded"] and ours["meta_params"]
    if case != "explicit_map":
        assert ours["max_memory_after"] == {"cpu": 60_000}  # the caller's "60KB", converted in place
    _same_as_accelerate(results, case, ours)


def test_peft_lora_on_a_disk_offloaded_model_and_merge(results):
    ours = _ours(results, "peft_lora_on_dispatched_model")
    assert ours["logits_equal"] and ours["merged_equal"], ours
    assert any(".lora_A." in name for name in ours["offloaded"])
    _same_as_accelerate(results, "peft_lora_on_dispatched_model", ours)


def test_peft_from_pretrained_with_a_device_map(results):
    ours = _ours(results, "peft_from_pretrained_with_device_map")
    assert ours["logits_equal"], ours
    _same_as_accelerate(results, "peft_from_pretrained_with_device_map", ours)


@pytest.mark.parametrize("case", ["diffusers_model_cpu_offload", "diffusers_sequential_cpu_offload"])
def test_diffusers_offload_gives_the_same_images(results, case):
    """On a machine without an accelerator the execution device is the cpu (device="cpu"): the hooks,
    placements and images are checked here; the move to an accelerator and back is the GPU check's
    (tests/big_modeling/test_big_model_devices.py with a device plugin)."""
    ours = _ours(results, case)
    assert ours["equal"] and ours["after_removal_equal"] and ours["hooks_left"] == 0, ours
    if case == "diffusers_sequential_cpu_offload":
        assert ours["offloaded"] and ours["meta_left"] == 0
    _same_as_accelerate(results, case, ours)
