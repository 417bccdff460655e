"""ParallelismConfig as Accelerate's: sizes from PARALLELISM_CONFIG_* when not given, the context-parallel handler
from PARALLELISM_CONFIG_CP_COMM_STRATEGY, the mesh's dimension names and order, and build_device_mesh on 4 real
gloo processes, each beside Accelerate's own ParallelismConfig."""

import json
from types import SimpleNamespace

import pytest

from torchbay.distributed.parallelism_config import ParallelismConfig, TorchContextParallelConfig
from torchbay.errors import ConfigError
from torchbay.testing.processes import run_torchrun

accelerate_pc = pytest.importorskip("accelerate.parallelism_config", reason="Accelerate (a dev dependency) is the "
                                    "reference")


def accelerates(**sizes):
    """Accelerate's ParallelismConfig; its TorchTensorParallelConfig checks the transformers version (absent from
    torchbay's venv), so it gets a stand-in handler: neither the sizes nor the mesh read it."""
    return accelerate_pc.ParallelismConfig(tp_handler=SimpleNamespace(), **sizes)


SIDES = {"accelerate": accelerates, "torchbay": ParallelismConfig}
SIZES = [(2, 2, 2, 2), (1, 4, 2, 1), (1, 2, 2, 2), (1, 1, 1, 4), (8, 1, 1, 1)]


@pytest.mark.parametrize("dp_replicate, dp_shard, tp, cp", SIZES)
def test_sizes_come_from_the_environment_when_not_given(monkeypatch, dp_replicate, dp_shard, tp, cp):
    for name, size in (("DP_REPLICATE", dp_replicate), ("DP_SHARD", dp_shard), ("TP", tp), ("CP", cp)):
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name}_SIZE", str(size))
    for cls in SIDES.values():
        config = cls()
        assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == \
            (dp_replicate, dp_shard, tp, cp)
    assert ParallelismConfig(tp_size=1).tp_size == 1  # a size given wins over the environment


@pytest.mark.parametrize("dp_replicate, dp_shard, tp, cp", SIZES)
def test_mesh_names_and_order_are_accelerates(dp_replicate, dp_shard, tp, cp):
    theirs, ours = (cls(dp_replicate_size=dp_replicate, dp_shard_size=dp_shard, tp_size=tp, cp_size=cp)
                    for cls in SIDES.values())
    assert ours._get_mesh() == theirs._get_mesh()
    for names in ("active_mesh_dims", "dp_dim_names", "non_dp_dim_names", "dp_shard_cp_dim_names",
                  "dp_cp_dim_names", "fsdp_dim_names"):
        assert getattr(ours, names) == getattr(theirs, names), names


def test_cp_comm_strategy_from_the_environment(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == "alltoall"
    assert TorchContextParallelConfig("allgather").cp_comm_strategy == "allgather"
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "ring")
    with pytest.raises(ConfigError, match="Invalid cp_comm_strategy: ring.*PARALLELISM_CONFIG_CP_COMM_STRATEGY"):
        ParallelismConfig(cp_size=2)


def test_a_size_in_the_environment_that_is_no_number_names_the_variable(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ConfigError, match="PARALLELISM_CONFIG_TP_SIZE='two'"):
        ParallelismConfig()


def test_get_device_mesh_without_a_mesh_or_a_device_type_says_what_to_pass():
    assert ParallelismConfig().build_device_mesh("cpu") is None  # nothing enabled: no mesh, as Accelerate
    with pytest.raises(ConfigError, match=r"get_device_mesh\('cpu'\)"):
        ParallelismConfig(dp_shard_size=2).get_device_mesh()


@pytest.mark.multiprocess
def test_build_device_mesh_on_four_gloo_processes_matches_accelerates(tmp_path, script):
    run_torchrun(script("parallelism_mesh.py"), 4, [str(tmp_path)]).check()
    for rank in range(4):
        cases = json.loads((tmp_path / f"mesh_rank{rank}.json").read_text())
        for sizes, sides in cases.items():
            assert sides["torchbay"] == sides["accelerate"], (rank, sizes)
            assert sides["torchbay"]["device"] == "cpu"
    two_by_two = json.loads((tmp_path / "mesh_rank3.json").read_text())["dp_replicate_size=2,dp_shard_size=2"]
    assert two_by_two["torchbay"]["groups"] == {"dp_replicate": [1, 3], "dp_shard": [2, 3], "dp": [0, 1, 2, 3],
                                                "dp_shard_cp": [2, 3], "dp_cp": [0, 1, 2, 3]}


def _model(layer_types=None):
    config = SimpleNamespace(get_text_config=lambda: config)
    if layer_types is not None:
        config.layer_types = layer_types
    return SimpleNamespace(config=config)


@pytest.mark.parametrize("layer_types", [None, ["full_attention"], ["full_attention", "linear_attention"]])
def test_recurrent_layers_are_refused_before_the_sequence_is_sharded_as_accelerate(layer_types):
    from accelerate.big_modeling import _refuse_recurrent_layers_under_sequence_parallelism as theirs

    from torchbay.big_modeling.modeling import _refuse_recurrent_layers_under_sequence_parallelism as ours

    outcomes = []
    for check in (theirs, ours):
        try:
            check(_model(layer_types))
            outcomes.append(None)
        except ValueError as refused:
            assert "linear_attention" in str(refused)
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1] == ("refused" if layer_types and "linear_attention" in layer_types else None)
