"""Small helpers of accelerate.utils as Accelerate's users see them (issue 36): check_os_kernel's warning,
get_model_tp_size, undoing a hand-made fp32 output wrapper, and Accelerate's logger names under the switch.
Where the real Accelerate is installed, the same call is made on it and the answers compared."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from unittest.mock import Mock, patch

import pytest
import torch

from torchbay.compat import helpers
from torchbay.data.operations import convert_outputs_to_fp32

HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None


def _implementations():
    yield helpers
    if HAVE_ACCELERATE:
        from accelerate.utils import other

        yield other


IMPLS = pytest.mark.parametrize("impl", list(_implementations()), ids=lambda m: m.__name__.split(".")[0])


@IMPLS
def test_an_old_linux_kernel_is_warned_about_once(impl, caplog):
    if impl is not helpers:  # Accelerate's logger needs its state
        from accelerate import PartialState

        PartialState()
    with patch("platform.uname", return_value=Mock(release="5.4.0-35-generic", system="Linux")), \
            caplog.at_level(logging.INFO):
        impl.check_os_kernel()
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "5.4.0" in caplog.records[0].msg and "5.5.0" in caplog.records[0].msg


@IMPLS
def test_a_recent_kernel_or_another_system_is_not_warned_about(impl, caplog):
    for release, system in (("6.1.0-generic", "Linux"), ("5.4.0", "Darwin")):
        with patch("platform.uname", return_value=Mock(release=release, system=system)), \
                caplog.at_level(logging.INFO):
            impl.check_os_kernel()
    assert caplog.records == []


@IMPLS
def test_get_model_tp_size_reads_the_model_then_its_distributed_config(impl):
    model = torch.nn.Linear(2, 2)
    assert impl.get_model_tp_size(model) is None
    model.tp_size = 2
    assert impl.get_model_tp_size(model) == 2
    model.tp_size = None
    model.config = SimpleNamespace(distributed_config=SimpleNamespace(tp_size=4))
    assert impl.get_model_tp_size(model) == 4
    model.config = SimpleNamespace(distributed_config={"tp_size": 8})
    assert impl.get_model_tp_size(model) == 8


@IMPLS
def test_a_hand_made_fp32_wrapper_is_undone_and_the_model_pickles(impl):
    model = torch.nn.Linear(2, 2)
    model._original_forward = model.forward
    model.forward = convert_outputs_to_fp32(model.forward)
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(model)
    model = impl.extract_model_from_parallel(model, keep_fp32_wrapper=False)
    restored = pickle.loads(pickle.dumps(model))
    assert "_original_forward" not in model.__dict__
    assert torch.equal(restored(torch.ones(1, 2)), restored.forward(torch.ones(1, 2)))


def test_under_the_switch_accelerates_environment_logger_hears_the_launch_helpers():
    code = """
        import json, logging, torchbay.compat
        torchbay.compat.as_accelerate()
        from accelerate.utils import convert_dict_to_env_variables
        heard = []
        handler = logging.Handler()
        handler.emit = lambda record: heard.append(record.levelname)
        logging.getLogger("accelerate.utils.environment").addHandler(handler)
        kept = convert_dict_to_env_variables({"A": "1", "BAD": "<x"})
        print(json.dumps({"kept": kept, "heard": heard}))
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"kept": ["A=1\n"], "heard": ["WARNING"]}


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = self.a


def test_save_safetensors_drops_shared_tensors_with_one_warning(tmp_path, caplog):
    model = Tied()
    state = model.state_dict()
    with caplog.at_level(logging.WARNING):
        helpers.save(state, tmp_path / "model.safetensors", safe_serialization=True)
    assert len(caplog.records) == 1 and "Removed shared tensor" in caplog.records[0].getMessage()
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "model.safetensors")) == ["a.bias", "a.weight"]
    assert sorted(state) == ["a.bias", "a.weight", "b.bias", "b.weight"]  # the caller's dict is left as it was
