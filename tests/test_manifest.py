"""`DST/export_manifest.json` and `verify`: every hash against hashlib over the arrays read with tensorstore or the
safetensors bytes parsed here, every error field against numpy over the source and the stored values; the export
takes them while it writes, reading none of its output back."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from hostile import TINY_CKPT_MODEL, check_one_line
from test_export_distributed import CKPT, _arrays

from inspect_tool.manifest import stored

from conftest import REPO
TOKENS = [*TINY_CKPT_MODEL, "quantization=fp8_full", "quantize_mtp=true"]
E4M3_MAX = 448.0


def _cli(*argv, timeout=300):
  return subprocess.run([sys.executable, "-m", "inspect_tool", *map(str, argv)], capture_output=True, text=True,
                        cwd=REPO, check=False, timeout=timeout, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _export_reading_nothing_back(dst, *extra, tokens=TOKENS, checkpoint=CKPT) -> None:
  """The export, in this process, with every read of an export's stored tensors refused: its manifest comes from
  what it wrote."""
  from inspect_tool import cli  # pylint: disable=import-outside-toplevel

  def refused(self, path):
    raise AssertionError(f"the export read {path} back")

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(stored.StoredTensors, "__init__", refused)
    assert cli.main(["export", *tokens, "--checkpoint", str(checkpoint), "--output", str(dst), "--no-validate",
                     "--quiet", *extra]) == 0


@pytest.fixture(scope="module")
def orbax_export(tmp_path_factory):
  dst = tmp_path_factory.mktemp("orbax") / "dst"
  _export_reading_nothing_back(dst)
  return dst


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
  dst = tmp_path_factory.mktemp("hf") / "dst"
  _export_reading_nothing_back(dst, "--layout", "deepseek-fp8")
  return dst


def _manifest(dst) -> dict:
  return json.loads((dst / "export_manifest.json").read_text())


def _safetensors(dst) -> dict[str, tuple[str, bytes]]:
  """name -> (dtype tag, its bytes), parsed from the shards here (8-byte length, JSON header, data)."""
  out = {}
  for shard in sorted(dst.glob("*.safetensors")):
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    for name, entry in header.items():
      if name != "__metadata__":
        begin, end = entry["data_offsets"]
        out[name] = (entry["dtype"], raw[8 + length + begin:8 + length + end])
  return out


def _error(source: np.ndarray, dequantized: np.ndarray, absmax: np.ndarray) -> dict:
  error = np.abs(dequantized.astype(np.float64) - source.astype(np.float64))
  return {"max_abs": error.max(), "mean_abs": error.mean(), "max_over_block_absmax": (error / absmax).max()}


def _check_error(entry: dict, expected: dict) -> None:
  got = entry["error"]
  for field, value in expected.items():
    assert got[field] == pytest.approx(value, rel=2e-6, abs=1e-12), (entry["name"], field, got[field], value)


def test_the_orbax_manifest_hashes_every_stored_array_and_measures_every_quantized_one(orbax_export):
  doc = _manifest(orbax_export)
  stored_arrays, source = _arrays(str(orbax_export)), _arrays(CKPT)
  entries = {e["name"]: e for e in doc["tensors"]}
  assert sorted(entries) == sorted(stored_arrays) and len(entries) == 86 and doc["layout"] == "orbax"
  quantized = 0
  for name, entry in entries.items():
    array = stored_arrays[name]
    assert entry["sha256"] == hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(), name
    assert (entry["shape"], entry["dtype"]) == (list(array.shape), array.dtype.name), name
    if "scale_of" in entry:
      assert [entry["zero"], entry["nan"], entry["inf"]] == [int((array == 0).sum()), int(np.isnan(array).sum()),
                                                             int(np.isinf(array).sum())]
    if not entry["quantized"]:
      continue
    quantized += 1
    assert name.endswith(".array.qvalue") and array.dtype == ml_dtypes.float8_e4m3fn
    original = source[entry["source"]["key"].replace("/", ".")]
    assert entry["source"]["shape"] == list(original.shape) == list(array.shape)
    scale = stored_arrays[entry["scale"]["name"]].astype(np.float32)
    assert entry["scale"]["blocks"] == scale.size and entry["scale"]["layout"].startswith("per channel")
    # Against the float32 source as stored (Qwix's PTQ casts it to bfloat16 first: that rounding is in the error).
    dequantized = array.astype(np.float32) * scale
    _check_error(entry, _error(original, dequantized,
                               np.broadcast_to(np.abs(scale) * E4M3_MAX, array.shape)))
    assert 0 < entry["error"]["max_over_block_absmax"] <= 1 / 16 + 1e-6  # e4m3's rounding: half of 2^-3
  assert quantized == doc["totals"]["quantized"] == sum(n.endswith(".array.qvalue") for n in stored_arrays) == 33


def test_the_deepseek_fp8_manifest_hashes_the_shard_bytes_and_measures_the_128_blocks(hf_export):
  doc = _manifest(hf_export)
  tensors = _safetensors(hf_export)
  entries = {e["name"]: e for e in doc["tensors"]}
  assert sorted(entries) == sorted(tensors) and doc["layout"] == "deepseek-fp8"
  for name, (dtype, data) in tensors.items():
    assert entries[name]["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert entries[name]["quantized"] == (dtype == "F8_E4M3"), name
  # One routed expert, by hand: layer 1 is the first MoE layer (stack index 0), expert 3's gate_proj = wi_0[3, 0].T.
  name = "model.layers.1.mlp.experts.3.gate_proj.weight"
  entry = entries[name]
  assert entry["source"]["key"].endswith("moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0")
  original = _arrays(CKPT)[entry["source"]["key"].replace("/", ".")][3, 0].T
  qvalue = np.frombuffer(tensors[name][1], ml_dtypes.float8_e4m3fn).reshape(entry["shape"]).astype(np.float32)
  scale = np.frombuffer(tensors[name + "_scale_inv"][1], np.float32).reshape(entries[name + "_scale_inv"]["shape"])
  assert entry["scale"]["blocks"] == scale.size and entry["scale"]["layout"].startswith("128x128 blocks")
  block = np.kron(scale, np.ones((128, 128), np.float32))[:qvalue.shape[0], :qvalue.shape[1]]
  _check_error(entry, _error(original, qvalue * block, np.abs(block) * E4M3_MAX))
  fp8 = [e for e in entries.values() if e["quantized"]]
  assert len(fp8) == doc["totals"]["quantized"] > 50
  assert all(0 < e["error"]["max_over_block_absmax"] <= 1 / 16 + 1e-6 for e in fp8)


V4_RELEASE = os.path.join(REPO, "tests", "data", "v4", "v4_release")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _decoded_scales(dtype: str, data: bytes) -> np.ndarray:
  """A scale tensor's values: float32, or e8m0 bytes (2^(b - 127), 255 NaN), decoded here."""
  if dtype == "F32":
    return np.frombuffer(data, np.float32)
  codes = np.frombuffer(data, np.uint8).astype(np.int32)
  return np.where(codes == 255, np.float32(np.nan), np.ldexp(np.float32(1), codes - 127).astype(np.float32))


@pytest.mark.parametrize("layout", ["ue8m0", "deepseek-v4"])
def test_the_ue8m0_and_v4_manifests_hash_the_shard_bytes_count_the_scales_and_measure_a_matrix(layout,
                                                                                                 tmp_path):
  dst = tmp_path / "dst"
  if layout == "ue8m0":
    _export_reading_nothing_back(dst, "--layout", "deepseek-fp8", "--scale-fmt", "ue8m0")
    source, name = _arrays(CKPT), "model.layers.1.mlp.experts.3.gate_proj.weight"  # wi_0[3, 0].T
  else:  # the tiny DeepSeek-V4 release, imported, then exported in its own layout (FP4 experts); its weights were
    # FP4 and FP8 already, so its errors are 0 (tests/test_manifest_digests.py measures others on these formats)
    keys = _cli("hf", "--path", V4_RELEASE, "--keys").stdout.split() + ["mtp_num_layers=0"]
    done = _cli("import", "--path", V4_RELEASE, "--output", tmp_path / "src", *keys)
    assert done.returncode == 0, done.stderr[-2000:]
    _export_reading_nothing_back(dst, "--layout", "deepseek-v4", tokens=keys, checkpoint=tmp_path / "src")
    source, name = _arrays(str(tmp_path / "src")), "layers.0.ffn.experts.3.w1.weight"  # wi_0[3].T, FP4
  doc, tensors = _manifest(dst), _safetensors(dst)
  entries = {e["name"]: e for e in doc["tensors"]}
  assert sorted(entries) == sorted(tensors) and doc["layout"] == ("deepseek-v4" if layout != "ue8m0" else
                                                                   "deepseek-fp8-ue8m0")
  for tensor, (dtype, data) in tensors.items():
    entry = entries[tensor]
    assert entry["sha256"] == hashlib.sha256(data).hexdigest(), tensor
    if "scale_of" in entry:
      scales = _decoded_scales(dtype, data)
      assert [entry["zero"], entry["nan"], entry["inf"]] == [int((scales == 0).sum()), int(np.isnan(scales).sum()),
                                                             int(np.isinf(scales).sum())], tensor
      assert entries[entry["scale_of"]]["quantized"] and entries[entry["scale_of"]]["scale"]["name"] == tensor
  matrices = {name: source[entries[name]["source"]["key"].replace("/", ".")][3, 0].T if layout == "ue8m0" else
              source[entries[name]["source"]["key"].replace("/", ".")][3].T}
  if layout != "ue8m0":  # and an FP8 matrix of V4's: float8_e8m0fnu scales per 128 x 128 block
    matrices["layers.0.attn.wkv.weight"] = source["params.params.decoder.layers_0.self_attention.wkv.kernel"].reshape(
        64, 64).T
  for matrix, original in matrices.items():
    _check_matrix(entries[matrix], entries[entries[matrix]["scale"]["name"]], tensors, original)


def _check_matrix(entry: dict, scale_entry: dict, tensors: dict, original: np.ndarray) -> None:
  """The error fields of one quantized matrix against numpy: FP8 (128 x 128 blocks) or packed FP4 (groups of 32)."""
  scale = _decoded_scales(*tensors[scale_entry["name"]]).reshape(scale_entry["shape"])
  if entry["dtype"] == "float8_e4m3fn":
    qvalue = np.frombuffer(tensors[entry["name"]][1], ml_dtypes.float8_e4m3fn).reshape(entry["shape"])
    block = np.kron(scale, np.ones((128, 128), np.float32))[:qvalue.shape[0], :qvalue.shape[1]]
    dequantized, absmax = qvalue.astype(np.float32) * block, np.abs(block) * E4M3_MAX
    assert (np.log2(scale) == np.round(np.log2(scale))).all()  # ue8m0: powers of two
  else:  # two e2m1 values a byte, low nibble first; one e8m0 scale per 32 values of a row
    packed = np.frombuffer(tensors[entry["name"]][1], np.uint8).reshape(entry["shape"])
    values = E2M1[np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)]
    group = np.repeat(scale, 32, axis=-1)
    dequantized, absmax = values * group, group * 6.0
  assert entry["error"]["elements"] == original.size
  _check_error(entry, _error(original, dequantized, absmax))


@pytest.mark.parametrize("shape, piece", [((7, 5, 3), 24), ((4, 9), 4), ((3, 2, 2, 5), 1000), ((11,), 8), ((), 4),
                                          ((2, 0, 3), 8), ((5, 6), 7)])
def test_slabs_cover_every_element_once_in_c_order(shape, piece):
  value = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
  pieces = [value[box].reshape(-1) for box in stored.slabs(shape, 4, piece)]
  assert all(p.nbytes <= max(piece, 4) for p in pieces)
  assert np.concatenate(pieces or [np.zeros(0, np.float32)]).tobytes() == value.tobytes()


@pytest.mark.parametrize("layout", ["orbax", "deepseek-fp8"])
def test_verify_passes_an_untouched_export_in_small_pieces(orbax_export, hf_export, layout):
  dst = orbax_export if layout == "orbax" else hf_export
  done = _cli("verify", dst, "--max-memory", "400MB")
  assert done.returncode == 0, done.stderr[-2000:]
  lines = done.stdout.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"verified {dst}: {len(_manifest(dst)['tensors'])} tensors")


def test_verify_names_the_changed_safetensors_tensor(hf_export, tmp_path):
  dst = tmp_path / "dst"
  shutil.copytree(hf_export, dst)
  name = "model.layers.2.mlp.experts.5.down_proj.weight"
  shard = dst / json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
  raw = bytearray(shard.read_bytes())
  (length,) = struct.unpack("<Q", raw[:8])
  begin = json.loads(raw[8:8 + length])[name]["data_offsets"][0] + 8 + length
  raw[begin + 100] ^= 0x01  # one bit of one value
  shard.write_bytes(bytes(raw))
  done = _cli("verify", dst)
  assert done.returncode == 1 and done.stdout.startswith(f"FAILED: {dst}: tensor {name} differs"), done.stdout


def test_verify_names_the_changed_orbax_array_and_a_tensor_the_manifest_lacks(orbax_export, tmp_path):
  dst = tmp_path / "dst"
  shutil.copytree(orbax_export, dst)
  name = "params.params.decoder.moe_layers.self_attention.wq_b.kernel.array.qvalue"
  base = {"driver": "ocdbt", "base": {"driver": "file", "path": str(dst / "0" / "items") + "/"}}
  array = ts.open({"driver": "zarr3", "kvstore": dict(base, path=name + "/")}, open=True).result()
  value = array[0, 0, 0, :1].read().result()
  array[0, 0, 0, :1].write(-value.astype(np.float32).astype(value.dtype)
                           if float(value[0]) else np.ones(1, value.dtype)).result()
  done = _cli("verify", dst)
  assert done.returncode == 1 and done.stdout.startswith(f"FAILED: {dst}: tensor {name} differs"), done.stdout
  shutil.rmtree(dst)
  shutil.copytree(orbax_export, dst)
  doc = _manifest(dst)
  dropped = doc["tensors"].pop(5)["name"]
  (dst / "export_manifest.json").write_text(json.dumps(doc))
  done = _cli("verify", dst)
  assert done.returncode == 1 and f"stores tensor {dropped}, which the manifest does not list" in done.stdout


@pytest.mark.parametrize("manifest, says", [(None, "no export_manifest.json"), ("{", "export_manifest.json"),
                                            ('{"kind": "x", "tensors": []}', "not an export manifest")])
def test_verify_of_a_directory_without_a_good_manifest_is_one_line(hf_export, tmp_path, manifest, says):
  dst = tmp_path / "dst"
  shutil.copytree(hf_export, dst)
  (dst / "export_manifest.json").unlink()
  if manifest is not None:
    (dst / "export_manifest.json").write_text(manifest)
  done = _cli("verify", dst)
  check_one_line(done.returncode, done.stdout, done.stderr, says)


def test_verify_reads_an_export_on_gs(gcs, orbax_export, hf_export):
  gcs.create_bucket("manifest-bucket")
  for layout, dst in (("orbax", orbax_export), ("hf", hf_export)):
    url = gcs.upload(dst, f"gs://manifest-bucket/{layout}")
    done = subprocess.run([sys.executable, "-m", "inspect_tool", "verify", url], capture_output=True, text=True,
                          cwd=REPO, check=False, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0 and done.stdout.startswith(f"verified {url}: "), done.stderr[-2000:]
