"""``accelerate to-fsdp2`` as torchbay-fsdp serves it: an FSDP1 Accelerate config rewritten for FSDP2 into a new
file; the user's file and an existing output are never written over."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from torchbay_fsdp import to_fsdp2

from torchbay.errors import ConfigError

FSDP1 = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
         "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_use_orig_params": True,
                         "fsdp_offload_params": False}}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "fsdp1.yaml"
    path.write_text(yaml.safe_dump(FSDP1))
    return path


def test_the_converted_config_is_written_to_a_new_file(config, tmp_path):
    out = tmp_path / "fsdp2.yaml"
    assert to_fsdp2.main(["--config_file", str(config), "--output_file", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["fsdp_config"] == {"fsdp_reshard_after_forward": False,
                                                              "fsdp_offload_params": False, "fsdp_version": 2}
    assert yaml.safe_load(config.read_text()) == FSDP1  # the user's file as it was


def test_neither_the_users_file_nor_an_existing_output_is_written_over(config, tmp_path):
    out = tmp_path / "taken.yaml"
    out.write_text("mine\n")
    with pytest.raises(FileExistsError, match="does not write over it"):
        to_fsdp2.main(["--config_file", str(config), "--output_file", str(out)])
    with pytest.raises(ConfigError, match="--overwrite would write over"):
        to_fsdp2.main(["--config_file", str(config), "--overwrite"])
    assert out.read_text() == "mine\n" and yaml.safe_load(config.read_text()) == FSDP1


def test_whether_a_file_exists_is_asked_of_pathlib(config, tmp_path, monkeypatch):
    """As Accelerate's command asks it (its test patches ``pathlib.Path.exists`` to make the output exist)."""
    out = tmp_path / "new.yaml"
    real_exists = pathlib.Path.exists
    monkeypatch.setattr(pathlib.Path, "exists", lambda self: self == out or real_exists(self))
    with pytest.raises(FileExistsError):
        to_fsdp2.main(["--config_file", str(config), "--output_file", str(out)])
    assert not real_exists(out)
