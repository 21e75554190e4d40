"""``zeropp.save_full_weights`` in one process (no process group: the state dict's tensors are
whole): the safetensors it streams, its shards and index, tied weights, and a failed write."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from models import make_model
from zeropp.checkpoint.full import entries, header, plan_files, save_full_weights, tied_names


def test_one_file_holds_every_tensor_once_and_safetensors_reads_it(tmp_path) -> None:
    model = make_model("tied")  # the output head is the embedding: one tensor under one name
    written = save_full_weights(model, tmp_path)
    assert [p.name for p in written] == ["model.safetensors"]
    loaded = load_file(tmp_path / "model.safetensors")
    state = model.state_dict()
    assert set(loaded) == set(state) - set(tied_names(model))
    for name, value in loaded.items():
        assert torch.equal(value, state[name]), name


def test_a_model_over_the_shard_size_is_split_with_transformers_index(tmp_path) -> None:
    model = make_model("gpt")
    (tmp_path / "model.safetensors").write_bytes(b"an earlier save")  # replaced, never mixed in
    written = save_full_weights(model, tmp_path, max_shard_bytes=4096, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in written) == [*files, "model.safetensors.index.json"]
    assert not (tmp_path / "model.safetensors").exists()
    loaded = {name: value for f in files for name, value in load_file(tmp_path / f).items()}
    assert set(loaded) == set(index["weight_map"]) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value.to(torch.bfloat16)), name
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in loaded.values())


def test_the_header_names_every_byte_range_in_order() -> None:
    chosen = entries({"a": torch.zeros(3, dtype=torch.float32), "b": torch.zeros(2, 2, dtype=torch.bfloat16)})
    raw = header(chosen)
    length = int.from_bytes(raw[:8], "little")
    assert length == len(raw) - 8 and length % 8 == 0
    described = json.loads(raw[8:])
    assert described["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert described["b"] == {"dtype": "BF16", "shape": [2, 2], "data_offsets": [12, 20]}
    assert plan_files(chosen, 12) == [("model-00001-of-00002.safetensors", chosen[:1]),
                                      ("model-00002-of-00002.safetensors", chosen[1:])]


def test_a_failed_write_raises_and_leaves_no_partial_file(tmp_path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    os.chmod(target, 0o500)  # not writable
    if os.access(target, os.W_OK):  # root ignores the mode
        target.chmod(0o700)
        (target / "model.safetensors.partial").mkdir()  # the temporary name is taken: open() fails
    with pytest.raises(OSError, match="saving the full model"):
        save_full_weights(make_model("gpt"), target)
    assert not (target / "model.safetensors").exists()
