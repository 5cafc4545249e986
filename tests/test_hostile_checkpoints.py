"""Hostile Orbax metadata and safetensors files: one line naming the file, exit 2, no hang (issue 13, item 6)."""

import json
import os
import shutil
import struct

import pytest

from inspect_tool.hf import safetensors_header

from hostile import REF_CKPT, TINY_CKPT_MODEL, deny_reading, refused, refused_in_subprocess

DEEP = "[" * 100_000 + "]" * 100_000


def _copy(tmp_path) -> str:
  dst = str(tmp_path / "ckpt")
  shutil.copytree(REF_CKPT, dst)
  return dst


def _items(ckpt: str) -> str:
  return os.path.join(ckpt, "0", "items")


def _edit_metadata(ckpt: str, edit) -> str:
  path = os.path.join(_items(ckpt), "_METADATA")
  with open(path, encoding="utf-8") as f:
    doc = json.load(f)
  text = edit(doc)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text if isinstance(text, str) else json.dumps(doc))
  return path


def _first_array(doc) -> dict:
  return next(node for node in doc["tree_metadata"].values() if node["value_metadata"]["value_type"] == "jax.Array")


# --- Orbax ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, expected", [
    (lambda doc: json.dumps(doc)[:-1] + ', "x": ' + DEEP + "}", "JSON nested too deeply"),
    (lambda doc: doc["tree_metadata"][next(iter(doc["tree_metadata"]))].update(key_metadata=["str"]),
     "has ill-typed key_metadata or value_metadata"),
    (lambda doc: _first_array(doc).update(value_metadata=[1]), "has ill-typed key_metadata or value_metadata"),
    (lambda doc: json.dumps(doc).replace('"write_shape": [64]', '"write_shape": [1e400]', 1), "1e400 overflows"),
    (lambda doc: json.dumps(doc).replace('"write_shape": [64]', '"write_shape": [Infinity]', 1),
     "Infinity is not a JSON number"),
    (lambda doc: json.dumps(doc).replace('"key_type": 2', '"key_type": 1', 1), "has ill-typed key_metadata"),
])
def test_hostile_tree_metadata(capsys, tmp_path, edit, expected):
  ckpt = _copy(tmp_path)
  path = _edit_metadata(ckpt, edit)
  refused(capsys, ["orbax", "--path", ckpt], f"{path}: corrupt Orbax metadata", expected)


def _write_zarr_header(ckpt: str, edit) -> str:
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  items = os.path.abspath(_items(ckpt)) + "/"
  store = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": items}}).result()
  key = b"params.params.decoder.decoder_norm.scale/zarr.json"
  text = edit(store.read(key).result().value.decode())
  store.write(key, text.encode()).result()
  return "params.params.decoder.decoder_norm.scale/zarr.json"


@pytest.mark.parametrize("edit, expected", [
    (lambda text: text[:-1] + ', "x": ' + DEEP + "}", "JSON nested too deeply"),
    (lambda text: text.replace('"shape":[64]', '"shape":[1e400]'), "1e400 overflows a float"),
    (lambda text: text.replace('"shape":[64]', '"shape":"abc"'), "shape abc is not a list of integers"),
    (lambda text: text.replace('"shape":[64]', '"shape":[-64]'), "has dimension -64 outside [0, 2^63)"),
    (lambda text: text.replace('"shape":[64]', f'"shape":[{2**64}]'), "outside [0, 2^63)"),
    (lambda text: text.replace('"data_type":"float32"', '"data_type":[1]'), "data type [1] is not a name"),
    (lambda text: text.replace('"data_type":"float32"', '"data_type":"float99"'), "unknown data type 'float99'"),
    (lambda text: text.replace('"shape":[64]', '"shape":[64],"shape":[64]'), "key 'shape' appears twice"),
])
def test_hostile_zarr_header(capsys, tmp_path, edit, expected):
  ckpt = _copy(tmp_path)
  key = _write_zarr_header(ckpt, edit)
  refused(capsys, ["orbax", "--path", ckpt], "corrupt array metadata for " + key, expected)


@pytest.mark.parametrize("relative", [
    "_METADATA", "manifest.ocdbt", os.path.join("ocdbt.process_0", "d", "ea3cf9bc6a7a75e508bdfe66ed45508e")])
@pytest.mark.parametrize("command", ["orbax", "diff"])
def test_fifo_in_a_checkpoint_is_named_not_read(tmp_path, relative, command):
  ckpt = _copy(tmp_path)
  path = os.path.join(_items(ckpt), relative)
  os.remove(path)
  os.mkfifo(path)
  argv = ["orbax", "--path", ckpt] if command == "orbax" else ["diff", *TINY_CKPT_MODEL, "--path", ckpt]
  refused_in_subprocess(argv, f"{path}: is not a regular file", timeout=60)


def test_unreadable_items_directory_is_permission_denied(capsys, tmp_path, monkeypatch):
  ckpt = _copy(tmp_path)
  deny_reading(monkeypatch, _items(ckpt))
  line = refused(capsys, ["orbax", "--path", ckpt], "permission denied")
  assert "incomplete" not in line


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_data_chunk_prints_one_line(tmp_path, damage):
  """The restore fails in Orbax's asyncio reads; none of the teardown tracebacks may follow the line."""
  ckpt = _copy(tmp_path)
  data = os.path.join(_items(ckpt), "ocdbt.process_0", "d")
  chunk = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
  if damage == "truncate":
    os.truncate(chunk, os.path.getsize(chunk) // 3)
  else:
    os.remove(chunk)
  refused_in_subprocess(["forward", *TINY_CKPT_MODEL, "--checkpoint", ckpt], "an array data file is missing, "
                        "truncated or corrupt", timeout=300, cwd=str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing written


# --- safetensors ------------------------------------------------------------------------------------------

def _safetensors(path, header, data: bytes = b"") -> str:
  raw = header if isinstance(header, bytes) else json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + data)
  return str(path)


@pytest.mark.parametrize("header, data, expected", [
    (b'{"a": ' + DEEP.encode() + b"}", b"", "header is JSON nested too deeply"),
    (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, Infinity]}}', bytes(8), "Infinity is not a JSON"),
    (b'{"w": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 8]}}', bytes(8), "1e400 overflows"),
    ({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, bytes(8), "is not a list of integers"),
    ({"w": {"dtype": "F32", "shape": [-2, -4], "data_offsets": [0, 8]}}, bytes(8), "dimension -2 outside [0, 2^63)"),
    ({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "unknown dtype 'Q7'"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, bytes(8), "exceed the 8 data bytes"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8), "exceed the 8 data bytes"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]}}, bytes(8), "is not a pair of integers"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8), "holds 8 bytes; F32 [4] needs 16"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "'a' and 'b' overlap"),
    ({"w": {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 8]}}, bytes(8), "needs"),
    (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', bytes(8), "header is ambiguous JSON: key 'w' "
     "appears twice in one object"),
    (b'{"w": {"dtype": "F32", "dtype": "F16", "shape": [2], "data_offsets": [0, 8]}}', bytes(8),
     "key 'dtype' appears twice"),
])
def test_hostile_safetensors_header(capsys, tmp_path, header, data, expected):
  path = _safetensors(tmp_path / "m.safetensors", header, data)
  refused(capsys, ["hf", "--path", path], f"{path}: not a valid safetensors file", expected)


def test_header_over_the_cap_is_named_as_such(capsys, tmp_path):
  path = tmp_path / "m.safetensors"
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", safetensors_header.MAX_HEADER + 1))
    f.truncate(safetensors_header.MAX_HEADER + 100)  # sparse: the file is long enough, the header too long
  refused(capsys, ["hf", "--path", path], f"header length {safetensors_header.MAX_HEADER + 1} is over the "
          f"{safetensors_header.MAX_HEADER}-byte limit")


def test_header_longer_than_the_file(capsys, tmp_path):
  path = _safetensors(tmp_path / "m.safetensors", b"{}")
  with open(path, "r+b") as f:
    f.write(struct.pack("<Q", 10_000))
  refused(capsys, ["hf", "--path", path], "header length 10000 exceeds the file's 2 remaining bytes")


def test_fifo_safetensors_is_named_not_read(tmp_path):
  fifo = tmp_path / "m.safetensors"
  os.mkfifo(fifo)
  refused_in_subprocess(["hf", "--path", fifo], f"{fifo}: is not a regular file", timeout=60)
  other = tmp_path / "d"
  other.mkdir()
  os.mkfifo(other / "x.safetensors")
  refused_in_subprocess(["hf", "--path", other], "x.safetensors: is not a regular file", timeout=60)


def _index(tmp_path, weight_map) -> str:
  path = tmp_path / "model.safetensors.index.json"
  path.write_text(json.dumps({"weight_map": weight_map}) if not isinstance(weight_map, str) else weight_map)
  return str(path)


@pytest.mark.parametrize("weight_map, expected", [
    ({"w": "/etc/passwd"}, "shard '/etc/passwd' is not a file name inside"),
    ({"w": "../outside.safetensors"}, "shard '../outside.safetensors' is not a file name inside"),
    ({"w": 7}, "shard '7' is not a file name inside"),
    ('{"weight_map": ' + DEEP + "}", "JSON nested too deeply"),
    ('{"weight_map": {"w": NaN}}', "NaN is not a JSON number"),
    ('{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}', "key 'w' appears twice"),
])
def test_hostile_index(capsys, tmp_path, weight_map, expected):
  index = _index(tmp_path, weight_map)
  line = refused(capsys, ["hf", "--path", index], index, expected)
  assert "root:" not in line  # nothing of /etc/passwd is shown


def test_index_shard_symlink_leading_outside_is_refused(capsys, tmp_path):
  outside = tmp_path / "outside.safetensors"
  _safetensors(outside, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
  inner = tmp_path / "model"
  inner.mkdir()
  os.symlink(outside, inner / "shard.safetensors")
  index = _index(inner, {"w": "shard.safetensors"})
  refused(capsys, ["hf", "--path", index], "shard 'shard.safetensors' leads outside")


def test_fifo_or_hostile_config_json_does_not_block_the_summary(tmp_path):
  from inspect_tool.hf import layout as hf_layout  # pylint: disable=import-outside-toplevel
  _safetensors(tmp_path / "m.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
  (tmp_path / "config.json").write_text('{"num_experts_per_tok": NaN, "n_routed_experts": 256}')
  assert hf_layout.routed_fraction(str(tmp_path)) is None
  (tmp_path / "config.json").write_text('{"num_experts_per_tok": 8, "n_routed_experts": ' + DEEP + "}")
  assert hf_layout.routed_fraction(str(tmp_path)) is None
  (tmp_path / "config.json").write_text('{"num_experts_per_tok": 8, "n_routed_experts": 256}')
  assert hf_layout.routed_fraction(str(tmp_path)) == 8 / 256  # the control
  os.remove(tmp_path / "config.json")
  os.mkfifo(tmp_path / "config.json")
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  result = subprocess.run([sys.executable, "-m", "inspect_tool", "hf", "--path", str(tmp_path), "--summary"],
                          capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_teardown_noise_is_dropped_and_other_errors_kept(monkeypatch):
  """The hooks `quiet_closed_event_loop` installs (the race that triggers them cannot be forced in a test)."""
  import sys  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  from inspect_tool import errors  # pylint: disable=import-outside-toplevel

  seen = []
  monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(str(value)))
  monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(str(unraisable.exc_value)))
  errors.quiet_closed_event_loop()

  async def pending():
    return None

  coroutine = pending()
  sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
  sys.unraisablehook(types.SimpleNamespace(exc_value=ValueError("late read"), object=coroutine))
  sys.unraisablehook(types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None))
  coroutine.close()
  assert not seen
  sys.excepthook(ValueError, ValueError("a real error"), None)
  sys.unraisablehook(types.SimpleNamespace(exc_value=ValueError("kept"), object=None))
  assert seen == ["a real error", "kept"]
