"""Hugging Face input is hostile input (issue 18, item 6) and memory is estimated before a run allocates (item 7).

A DeepSeek FP8 directory is exported once from the reference checkpoint; each case damages a copy byte by byte
(at the offsets the safetensors header gives) and runs the commands that read it: exit 2 and one line naming
the tensor or file, nothing written.
"""

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from inspect_tool import cli
from inspect_tool.hf import tensors as hf_tensors
from inspect_tool.hf import safetensors_header
from inspect_tool.configuration import config
from inspect_tool.host import memory as host_memory
from inspect_tool.run import limits

from hostile import REF_CKPT, TINY_CKPT_MODEL, deny_reading, refused

SCALE = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
WEIGHT = SCALE[:-len("_scale_inv")]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
  dst = tmp_path_factory.mktemp("export") / "fp8"
  assert cli.main(["export", *TINY_CKPT_MODEL, "--checkpoint", REF_CKPT, "--output", str(dst), "--layout",
                   "deepseek-fp8", "--no-validate"]) == 0
  return str(dst)


def _copy(fp8_dir, tmp_path) -> str:
  path = str(tmp_path / "hf")
  shutil.copytree(fp8_dir, path)
  return path


def _shard(path: str, name: str) -> tuple[str, int]:
  """The file holding tensor `name` and the offset of its first data byte."""
  file, entry = safetensors_header.read_tensor_table(path)[name]
  return file, entry["start"]


def _poke(path: str, name: str, offset: int, data: bytes) -> str:
  file, start = _shard(path, name)
  with open(file, "r+b") as f:
    f.seek(start + offset)
    f.write(data)
  return file


def _readers(path: str, out: str) -> dict[str, list[str]]:
  return {"forward": ["forward", *TINY_CKPT_MODEL, "--checkpoint", path],
          "import": ["import", "--path", path, "--output", out]}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e38,
                                   hf_tensors.MAX_SCALE_INV * 2])
def test_a_bad_scale_is_one_line_naming_the_tensor(capsys, fp8_dir, tmp_path, value):
  path = _copy(fp8_dir, tmp_path)
  assert hf_tensors.Tensors(path).shape(SCALE) == (1, 1)  # a 64x64 weight: one 128x128 block
  file = _poke(path, SCALE, 0, np.float32(value).tobytes())
  for argv in _readers(path, str(tmp_path / "out")).values():
    line = refused(capsys, argv, f"{file}: tensor {SCALE!r} holds 1 bad scale(s)", "at [0, 0]",
                   "accepted: finite scales in (0,")
    assert repr(float(np.float32(value))) in line
  assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_an_fp8_nan_byte_is_one_line_naming_the_tensor(capsys, fp8_dir, tmp_path, byte):
  assert np.isnan(np.frombuffer(bytes([byte]), ml_dtypes.float8_e4m3fn)[0].astype(np.float32))  # numpy says NaN
  path = _copy(fp8_dir, tmp_path)
  file = _poke(path, WEIGHT, 77, bytes([byte]))
  for argv in _readers(path, str(tmp_path / "out")).values():
    refused(capsys, argv, f"{file}: tensor {WEIGHT!r} holds 1 NaN or inf float8 value(s)",
            f"flat index 77, byte {byte:#04x}")
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_every_finite_fp8_byte_is_accepted():
  """All 254 finite e4m3fn bytes pass the check (numpy/ml_dtypes decide which are finite)."""
  raw = np.arange(256, dtype=np.uint8)
  values = raw.view(ml_dtypes.float8_e4m3fn)
  finite = np.isfinite(values.astype(np.float32))
  assert finite.sum() == 254
  hf_tensors.check_fp8(values[finite], "t")
  for bad in values[~finite]:
    with pytest.raises(hf_tensors.errors.CheckpointError):
      hf_tensors.check_fp8(np.array([bad]), "t")


def test_dequantize_makes_nothing_larger_than_the_weight():
  """A block size of 2^30 (config.json's weight_block_size) gives one scale for the whole weight: the result is
  the weight times that scale (numpy's own product), with no 2^30-row intermediate."""
  rng = np.random.default_rng(0)
  q = rng.standard_normal((3, 5)).astype(ml_dtypes.float8_e4m3fn)
  scale = np.array([[0.5]], np.float32)
  np.testing.assert_array_equal(hf_tensors.dequantize(q, scale, (2**30, 2**30)), q.astype(np.float32) * 0.5)
  blocks = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)  # 2x3 blocks over (3, 5): edge blocks smaller
  assert hf_tensors.scale_shape((3, 5), (2, 3)) == blocks.shape
  want = q.astype(np.float32) * np.array([[1, 1, 1, 2, 2], [1, 1, 1, 2, 2], [3, 3, 3, 4, 4]], np.float32)
  np.testing.assert_array_equal(hf_tensors.dequantize(q, blocks, (2, 3)), want)


def test_a_header_claiming_4_tib_is_refused_before_allocation(tmp_path, fp8_dir):
  """A sparse file whose header claims a 4 TiB routing bias (the bias is read to decide routed_bias)."""
  path = tmp_path / "big"
  path.mkdir()
  shutil.copy(os.path.join(fp8_dir, "config.json"), path)
  name = "model.layers.1.mlp.gate.e_score_correction_bias"
  header = json.dumps({name: {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}).encode()
  file = path / "model.safetensors"
  file.write_bytes(struct.pack("<Q", len(header)) + header)
  os.truncate(file, 8 + len(header) + 2**42)
  with pytest.raises(hf_tensors.errors.CheckpointError) as info:
    hf_tensors.Tensors(str(path)).read(name)
  line = str(info.value)
  assert line.startswith(f"{file}: tensor {name!r} [1099511627776] needs 8192.0 GiB to read; available "), line


def test_an_unreadable_shard_is_one_line_naming_it(capsys, fp8_dir, tmp_path, monkeypatch):
  path = _copy(fp8_dir, tmp_path)
  file, _ = _shard(path, SCALE)
  deny_reading(monkeypatch, file)
  for argv in [*_readers(path, str(tmp_path / "out")).values(), ["diff", *TINY_CKPT_MODEL, "--path", path],
               ["hf", "--path", path]]:
    refused(capsys, argv, f"cannot read {file}", "Permission denied")
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_missing_config_json_is_named(capsys, fp8_dir, tmp_path):
  path = _copy(fp8_dir, tmp_path)
  os.remove(os.path.join(path, "config.json"))
  config_path = os.path.join(path, "config.json")
  for argv in (["forward", *TINY_CKPT_MODEL, "--checkpoint", path], ["diff", *TINY_CKPT_MODEL, "--path", path]):
    line = refused(capsys, argv, f"{config_path} is missing: {path} holds safetensors files")
    assert "Orbax" not in line
  refused(capsys, ["import", "--path", path, "--output", tmp_path / "out"], f"{config_path}: is missing")


# Memory (item 7) --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["orbax", "deepseek-fp8"])
def test_random_init_export_of_a_model_that_cannot_fit_is_refused_first(capsys, tmp_path, layout):
  cfg = config.resolve_config(["model_name=deepseek3-671b"])
  weights = limits.parameter_bytes(cfg)
  available, _ = host_memory.available_memory()
  assert available is not None and available < 2 * weights
  line = refused(capsys, ["export", "model_name=deepseek3-671b", "--random-init", "--output", tmp_path / "d",
                          "--layout", layout],
                 "export --random-init of deepseek3-671b needs about "
                 f"{(2 * weights + limits.RUNTIME_BYTES) / 2**30:.1f} GiB (weights {weights / 2**30:.1f} GiB), "
                 "available ")
  assert "use a smaller model" in line and not list(tmp_path.iterdir())


def test_random_init_estimate_is_weights_twice_plus_runtime(monkeypatch):
  cfg = config.resolve_config(["model_name=deepseek3-tiny"])
  needed = 2 * limits.parameter_bytes(cfg) + limits.RUNTIME_BYTES
  monkeypatch.setattr(host_memory, "available_memory", lambda: (needed, "test"))
  limits.check_init_memory(cfg, "export --random-init")  # exactly enough
  monkeypatch.setattr(host_memory, "available_memory", lambda: (needed - 1, "test"))
  with pytest.raises(limits.errors.InputError, match="needs about .* available"):
    limits.check_init_memory(cfg, "export --random-init")


def test_import_refuses_a_max_memory_under_what_it_holds(capsys, fp8_dir, tmp_path):
  refused(capsys, ["import", "--path", fp8_dir, "--output", tmp_path / "out", "--max-memory", "1KB"],
          "--max-memory 1000 B is not above the ", "this process already holds; accepted: more than ")
  assert not list(tmp_path.iterdir())
