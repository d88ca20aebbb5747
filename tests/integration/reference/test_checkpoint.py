"""Safetensors checkpoints: round trip, shards, cheap fingerprint."""

from __future__ import annotations

import json

import pytest
import torch

from adstore.integration.reference.checkpoint import (
    INDEX_NAME,
    checkpoint_fingerprint,
    read_checkpoint,
    write_header_checkpoint,
    write_random_checkpoint,
)
from adstore.integration.reference.models import ModelFactory
from adstore.store.errors import ConfigError


@pytest.fixture(scope="module")
def meta_model():
    return ModelFactory.from_config({"arch": "llama", "layers": 2, "hidden": 64}).build()


def test_round_trip_is_deterministic(meta_model, tmp_path):
    a = read_checkpoint(write_random_checkpoint(meta_model, tmp_path / "a", seed=5))
    b = read_checkpoint(write_random_checkpoint(meta_model, tmp_path / "b", seed=5))
    c = read_checkpoint(write_random_checkpoint(meta_model, tmp_path / "c", seed=6))
    assert set(a) == set(meta_model.state_dict())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    for k, t in a.items():
        assert t.shape == meta_model.state_dict()[k].shape and t.device.type == "cpu"
        assert torch.isfinite(t).all()


def test_sharded_checkpoint_has_index(meta_model, tmp_path):
    d = write_random_checkpoint(meta_model, tmp_path / "s", seed=5, max_shard_bytes=64 * 1024)
    files = sorted(p.name for p in d.iterdir())
    assert INDEX_NAME in files and sum(f.endswith(".safetensors") for f in files) > 1
    index = json.loads((d / INDEX_NAME).read_text())
    whole = read_checkpoint(write_random_checkpoint(meta_model, tmp_path / "w", seed=5))
    sharded = read_checkpoint(d)
    assert set(index["weight_map"]) == set(sharded) == set(whole)
    assert all(torch.equal(whole[k], sharded[k]) for k in whole)
    assert not list(d.glob("*.tmp*")) and not list(d.glob(".*"))


def test_fingerprint_reads_headers_not_data(meta_model, tmp_path):
    d1 = write_random_checkpoint(meta_model, tmp_path / "1", seed=1)
    d2 = write_random_checkpoint(meta_model, tmp_path / "2", seed=2)
    f1, f2 = checkpoint_fingerprint(d1), checkpoint_fingerprint(d2)
    assert f1 == f2  # same names, shapes, dtypes, sizes: the snapshot fits both
    path = d1 / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a tensor byte, not the header
    path.write_bytes(bytes(data))
    assert checkpoint_fingerprint(d1) == f1
    other = ModelFactory.from_config({"arch": "llama", "layers": 3, "hidden": 64}).build()
    assert checkpoint_fingerprint(write_random_checkpoint(other, tmp_path / "3")) != f1
    sharded = write_random_checkpoint(meta_model, tmp_path / "4", seed=1, max_shard_bytes=64 * 1024)
    assert checkpoint_fingerprint(sharded) != f1


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint_fingerprint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        checkpoint_fingerprint(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(ConfigError, match="header"):
        checkpoint_fingerprint(bad)
    (bad / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(ConfigError, match="too short"):
        checkpoint_fingerprint(bad)


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 64 * 1024], ids=["one_file", "sharded"])
def test_header_checkpoint_has_the_real_checkpoints_fingerprint(max_shard_bytes, tmp_path):
    # bfloat16 parameters beside float32 and int64 buffers: safetensors orders tensors by dtype, then name.
    model = ModelFactory.from_config({"arch": "deepseek_v3", "model_kwargs": {"torch_dtype": "bfloat16"}}).build()
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64, device="meta"))
    real = write_random_checkpoint(model, tmp_path / "real", max_shard_bytes=max_shard_bytes)
    empty = write_header_checkpoint(model, tmp_path / "empty", max_shard_bytes=max_shard_bytes)
    assert checkpoint_fingerprint(empty) == checkpoint_fingerprint(real)
    zeros = read_checkpoint(empty)  # a hole reads as zeros: a valid checkpoint, without weights
    assert set(zeros) == set(model.state_dict()) and all(not t.any() for t in zeros.values())
    assert not list(empty.glob("*.tmp*")) and not list(empty.glob(".*"))


def test_header_checkpoint_takes_no_disk_for_its_data(tmp_path):
    from adstore.integration.reference.published import published_factory

    model = published_factory("llama-3-70b", layers=2).build()  # 3.8 billion parameters, 7.6 GB in bfloat16
    files = list(write_header_checkpoint(model, tmp_path / "ckpt").iterdir())
    assert sum(f.stat().st_size for f in files) > 7 << 30
    assert sum(f.stat().st_blocks * 512 for f in files) < 1 << 20


def test_header_checkpoint_and_published_configs_refuse_bad_input(tmp_path):
    from adstore.integration.reference.published import published_config

    odd = torch.nn.Module()
    odd.register_buffer("z", torch.zeros(2, dtype=torch.complex32, device="meta"))
    with pytest.raises(ConfigError, match="no dtype"):
        write_header_checkpoint(odd, tmp_path / "odd")
    with pytest.raises(ConfigError, match="no published config"):
        published_config("llama-9")
    for layers in (0, -1, 2.5, "2"):
        with pytest.raises(ConfigError, match="positive layer count"):
            published_config("deepseek-v3", layers=layers)
    assert published_config("deepseek-v3", layers=1)["first_k_dense_replace"] == 0  # still one MoE layer
