"""load_state reads into the prepared objects' own tensors; save_state records files as it writes them."""

import os

import pytest
import torch
import xxhash

from torchbay import Accelerator
from torchbay.errors import CheckpointError
from torchbay.storage import files as ckfiles
from torchbay.storage import inplace as ci


def build(step=True, tie=False, config=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 16))
    if tie:
        model[2].weight = model[0].weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accelerator(config=config) if config else Accelerator()
    model, opt = acc.prepare(model, opt)
    if step:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
    return acc, model, opt


def optimizer_tensors(opt):
    return [v for s in opt.state.values() for _, v in sorted(s.items())]


def change(model, opt):
    with torch.no_grad():
        for t in [*model.state_dict().values(), *optimizer_tensors(opt)]:
            t.add_(1)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("step", [True, False])
def test_load_restores_in_place_bit_identical(tmp_path, tie, step):
    acc, model, opt = build(tie=tie)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = [t.clone() for t in optimizer_tensors(opt)]
    acc.save_state(str(tmp_path / "ck"))
    acc2, model2, opt2 = build(step=step, tie=tie)  # step=False: a fresh optimizer without state
    change(model2, opt2)
    weights = [p for p in model2.parameters()]
    acc2.load_state(str(tmp_path / "ck"))
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
    assert all(a is b for a, b in zip(weights, model2.parameters()))  # the same parameter objects
    restored = optimizer_tensors(opt2)
    assert len(restored) == len(saved_opt) and all(torch.equal(a, b) for a, b in zip(saved_opt, restored))
    if tie:
        assert model2[2].weight is model2[0].weight


def test_optimizer_state_tensors_are_reused(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    before = [t.data_ptr() for t in optimizer_tensors(opt)]
    change(model, opt)
    acc.load_state(str(tmp_path / "ck"))
    assert [t.data_ptr() for t in optimizer_tensors(opt)] == before


def test_a_model_that_does_not_fit_is_refused_as_before(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 16))
    acc2 = Accelerator()
    other, opt2 = acc2.prepare(other, torch.optim.AdamW(other.parameters()))
    with pytest.raises(CheckpointError, match="does not fit the prepared model"):
        acc2.load_state(str(tmp_path / "ck"))


def test_plans_change_nothing(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    change(model, opt)
    current = [t.clone() for t in [*model.state_dict().values(), *optimizer_tensors(opt)]]
    reads = acc.checkpoint_io.in_place_reads(tmp_path / "ck", "model_0", model.state_dict())
    plan = ci.plan_optimizer(opt, tmp_path / "ck" / "optimizer_0.pt", "optimizer 0")
    assert reads and plan is not None
    after = [*model.state_dict().values(), *optimizer_tensors(opt)]
    assert all(torch.equal(a, b) for a, b in zip(current, after))


def test_a_truncated_safetensors_file_is_not_read_in_place(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    path = tmp_path / "ck" / "model_0.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    assert acc.checkpoint_io.in_place_reads(tmp_path / "ck", "model_0", model.state_dict()) is None


def test_recorded_files_match_a_fresh_read(tmp_path):
    state = {"a": torch.randn(3_000_000), "b": torch.arange(7)}
    name = ckfiles.torch_save_recorded(state, tmp_path / "x.pt")
    record = ckfiles.record_files(tmp_path, [name])[name]
    data = (tmp_path / name).read_bytes()
    assert record == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    assert ckfiles.file_record(tmp_path / name) == record
    loaded = torch.load(tmp_path / name, weights_only=True)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    if hasattr(torch.serialization, "get_crc32_options"):
        assert torch.serialization.get_crc32_options()  # torch's own setting is restored


needs_crc_option = pytest.mark.skipif(not hasattr(torch.serialization, "get_crc32_options"),
                                      reason="torch < 2.6 has no set_crc32_options: every zip record has its CRC")


@needs_crc_option
def test_only_torchbays_own_save_skips_the_zip_crc(tmp_path, monkeypatch):
    import zipfile

    settings_while_writing = []
    write = ckfiles.RecordingWriter.write

    def watched(self, data):
        settings_while_writing.append(torch.serialization.get_crc32_options())
        return write(self, data)

    monkeypatch.setattr(ckfiles.RecordingWriter, "write", watched)
    ckfiles.torch_save_recorded({"a": torch.randn(100_000)}, tmp_path / "ours.pt")
    with zipfile.ZipFile(tmp_path / "ours.pt") as ours:
        assert {info.CRC for info in ours.infolist()} == {0}  # torchbay's file: no CRC computed
    assert settings_while_writing and all(settings_while_writing)  # torch's setting was back before the 1st byte

    torch.save({"a": torch.randn(100_000)}, tmp_path / "users.pt")  # the user's own save, right after
    with zipfile.ZipFile(tmp_path / "users.pt") as users:
        assert users.testzip() is None and all(info.CRC for info in users.infolist() if info.file_size)


@needs_crc_option
def test_a_save_state_leaves_the_users_crc_choice_alone(tmp_path):
    torch.serialization.set_crc32_options(False)  # the user's own choice, kept across torchbay's saves
    try:
        acc, model, opt = build()
        acc.save_state(str(tmp_path / "ck"))
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)


def test_a_record_is_not_reused_for_a_changed_file(tmp_path):
    name = ckfiles.torch_save_recorded({"a": torch.zeros(10)}, tmp_path / "x.pt")
    data = bytearray((tmp_path / name).read_bytes())
    data[-30] ^= 0xFF
    (tmp_path / name).write_bytes(bytes(data))
    os.utime(tmp_path / name, ns=(1, 1))
    assert ckfiles.record_files(tmp_path, [name])[name]["xxh3_128"] == xxhash.xxh3_128(bytes(data)).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 17, ckfiles.HASH_CHUNK + 5])
def test_file_digest_is_xxh3_128(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert ckfiles.file_record(tmp_path / "f", sync=False) == {"size": size,
                                                             "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
