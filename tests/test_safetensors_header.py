"""Tests for inspect_tool.hf.safetensors_header: header-only listings of safetensors files and sets."""

import json
import os
import struct

import numpy as np
import pytest
from safetensors import numpy as st_numpy

from inspect_tool import errors
from inspect_tool.paramtree import tree
from inspect_tool.hf import safetensors_header


def _handmade(path, entries, data_size=None, metadata=None):
  """Writes a safetensors file from `{name: (tag, shape, nbytes)}` without any library."""
  header, offset = {}, 0
  for name, (tag, shape, nbytes) in entries.items():
    header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  if metadata:
    header["__metadata__"] = metadata
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    f.truncate(8 + len(raw) + (offset if data_size is None else data_size))  # sparse data section
  return path


def test_single_file_lists_names_split_on_dots_shapes_and_dtypes(tmp_path):
  path = str(tmp_path / "model.safetensors")
  st_numpy.save_file({
      "model.layers.0.mlp.gate_proj.weight": np.zeros((8, 4), np.float32),
      "model.embed_tokens.weight": np.zeros((16, 4), np.float16),
      "model.layers.0.step": np.zeros((), np.int64),
  }, path, metadata={"format": "pt"})
  leaves = safetensors_header.read_leaves(path)
  assert leaves == [
      tree.Leaf(("model", "embed_tokens", "weight"), (16, 4), "float16"),
      tree.Leaf(("model", "layers", "0", "mlp", "gate_proj", "weight"), (8, 4), "float32"),
      tree.Leaf(("model", "layers", "0", "step"), (), "int64"),
  ]


def test_fp8_bf16_and_other_tags_map_to_numpy_names(tmp_path):
  path = _handmade(str(tmp_path / "q.safetensors"), {
      "a.weight": ("F8_E4M3", (4, 4), 16), "a.weight_scale_inv": ("F32", (1, 1), 4),
      "b.weight": ("F8_E5M2", (2, 2), 4), "c.weight": ("BF16", (3,), 6), "d.bias": ("I64", (1,), 8),
      "e.flag": ("BOOL", (2,), 2), "f.x": ("F8_E8M0", (1,), 1)}, metadata={"quant": "fp8"})
  got = {leaf.dotted: (leaf.shape, leaf.dtype) for leaf in safetensors_header.read_leaves(path)}
  assert got == {"a.weight": ((4, 4), "float8_e4m3fn"), "a.weight_scale_inv": ((1, 1), "float32"),
                 "b.weight": ((2, 2), "float8_e5m2"), "c.weight": ((3,), "bfloat16"), "d.bias": ((1,), "int64"),
                 "e.flag": ((2,), "bool"), "f.x": ((1,), "float8_e8m0fnu")}


def test_directory_of_files_is_merged_and_duplicates_are_refused(tmp_path):
  st_numpy.save_file({"x.a": np.zeros((2,), np.float32)}, str(tmp_path / "one.safetensors"))
  st_numpy.save_file({"x.b": np.zeros((3,), np.float32)}, str(tmp_path / "two.safetensors"))
  assert [l.dotted for l in safetensors_header.read_leaves(str(tmp_path))] == ["x.a", "x.b"]
  st_numpy.save_file({"x.a": np.zeros((2,), np.float32)}, str(tmp_path / "three.safetensors"))
  with pytest.raises(errors.CheckpointError, match="'x.a' is stored twice"):
    safetensors_header.read_leaves(str(tmp_path))


def _sharded(tmp_path, drop=None):
  st_numpy.save_file({"m.w1": np.zeros((2, 3), np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
  st_numpy.save_file({"m.w2": np.zeros((5,), np.float16)}, str(tmp_path / "model-00002-of-00002.safetensors"))
  index = {"metadata": {"total_size": 34}, "weight_map": {
      "m.w1": "model-00001-of-00002.safetensors", "m.w2": "model-00002-of-00002.safetensors"}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  if drop:
    os.remove(tmp_path / drop)


def test_sharded_set_uses_the_index_weight_map_from_file_or_directory(tmp_path):
  _sharded(tmp_path)
  want = [tree.Leaf(("m", "w1"), (2, 3), "float32"), tree.Leaf(("m", "w2"), (5,), "float16")]
  assert safetensors_header.read_leaves(str(tmp_path)) == want
  assert safetensors_header.read_leaves(str(tmp_path / "model.safetensors.index.json")) == want


def test_missing_shard_is_named(tmp_path):
  _sharded(tmp_path, drop="model-00002-of-00002.safetensors")
  with pytest.raises(errors.CheckpointError, match=r"1 shard file\(s\) missing: model-00002-of-00002"):
    safetensors_header.read_leaves(str(tmp_path))


def test_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
  _sharded(tmp_path)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  index["weight_map"]["m.w3"] = "model-00002-of-00002.safetensors"
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(errors.CheckpointError, match="lacks 1 tensor.*'m.w3'"):
    safetensors_header.read_leaves(str(tmp_path))


@pytest.mark.parametrize("content, message", [
    (b"\x01\x02", "shorter than the 8-byte header length"),
    (struct.pack("<Q", 10_000) + b"{}", "header length 10000 exceeds"),
    (struct.pack("<Q", 5) + b"{nope", "header is not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (struct.pack("<Q", 14) + b'{"a": {"x":1}}', "'a' lacks dtype/shape/data_offsets"),
])
def test_corrupt_header_is_one_line_error(tmp_path, content, message):
  path = tmp_path / "bad.safetensors"
  path.write_bytes(content)
  with pytest.raises(errors.CheckpointError, match=message) as info:
    safetensors_header.read_leaves(str(path))
  assert "\n" not in str(info.value)


def test_truncated_data_is_detected_from_offsets(tmp_path):
  path = _handmade(str(tmp_path / "t.safetensors"), {"w": ("F32", (4,), 16)}, data_size=8)
  with pytest.raises(errors.CheckpointError, match=r"'w' data_offsets \[0, 16\] exceed the 8 data bytes"):
    safetensors_header.read_leaves(path)


def test_missing_path_and_empty_directory(tmp_path):
  with pytest.raises(errors.CheckpointError, match="does not exist"):
    safetensors_header.read_leaves(str(tmp_path / "nope"))
  with pytest.raises(errors.CheckpointError, match=r"no \*.safetensors files"):
    safetensors_header.read_leaves(str(tmp_path))


def test_reading_does_not_touch_tensor_data(tmp_path):
  # A 64 GiB (sparse) data section: only a header-only reader lists it at once.
  path = _handmade(str(tmp_path / "big.safetensors"), {"w": ("BF16", (2**16, 2**19), 2**36)})
  assert safetensors_header.read_leaves(path) == [tree.Leaf(("w",), (2**16, 2**19), "bfloat16")]
