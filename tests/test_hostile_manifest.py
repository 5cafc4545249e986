"""A malformed `export_manifest.json` is a bad input (exit 2, one line naming the manifest and the entry), never a
tensor that differs (exit 1) nor a manifest that is missing (issue 51, item 5); `verify`'s exit codes as
docs/export.md states them; a `weight_block_size` of booleans is refused where config.json is read."""

import json
import os
import shutil

import pytest

from hostile import REF_CKPT, TINY_CKPT_MODEL, refused
from inspect_tool import cli

MANIFEST = "export_manifest.json"


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
  dst = tmp_path_factory.mktemp("export") / "fp8"
  assert cli.main(["export", *TINY_CKPT_MODEL, "quantization=fp8_full", "--checkpoint", REF_CKPT, "--output", str(dst),
                   "--layout", "deepseek-fp8", "--no-validate", "--quiet"]) == 0
  return dst


def _copy(export_dir, tmp_path):
  dst = tmp_path / "dst"
  shutil.copytree(export_dir, dst)
  return dst


def _edit(dst, change) -> tuple[int, str]:
  """Applies `change(entries)` to the manifest's tensors; returns (index, name) of the entry it changed."""
  doc = json.loads((dst / MANIFEST).read_text())
  index = change(doc["tensors"])
  (dst / MANIFEST).write_text(json.dumps(doc))
  return index, doc["tensors"][index]["name"]


def _first(entries, test) -> int:
  return next(i for i, entry in enumerate(entries) if test(entry))


def test_an_untouched_export_verifies(capsys, export_dir):
  assert cli.main(["verify", str(export_dir)]) == 0
  assert capsys.readouterr().out.startswith(f"verified {export_dir}:")


@pytest.mark.parametrize("sha256, says", [
    (lambda s: s[:40], "has a sha256 of 40 characters; accepted: 64 lowercase hex digits"),  # sha1's length
    (lambda s: s + "00", "has a sha256 of 66 characters; accepted: 64 lowercase hex digits"),
    (lambda s: s.upper(), "has a sha256 of 64 characters, not all lowercase hex"),
    (lambda s: "z" * 64, "has a sha256 of 64 characters, not all lowercase hex"),
    (lambda s: 12345, "has sha256 12345; accepted: 64 lowercase hex digits"),  # was "lacks 'sha256'"
    (lambda s: None, "has sha256 None; accepted"),
])
def test_a_malformed_sha256_is_a_malformed_manifest_not_a_differing_tensor(capsys, export_dir, tmp_path, sha256, says):
  dst = _copy(export_dir, tmp_path)

  def change(entries):
    entries[7]["sha256"] = sha256(entries[7]["sha256"])
    return 7

  index, name = _edit(dst, change)
  refused(capsys, ["verify", str(dst)], f"{dst / MANIFEST}: tensors[{index}] ({name!r}) {says}")


@pytest.mark.parametrize("field, value, says", [
    ("shape", "bools", "has shape [True"),  # [true, ...] equalled [1, ...] in the comparison
    ("shape", [-1], "has shape [-1]; accepted: a list of sizes"),
    ("shape", "64", "has shape '64'"),
    ("dtype", 7, "has dtype 7; accepted: a dtype name"),
    ("name", "", "has name ''; accepted: a tensor name"),
    ("zero", False, "has zero False; accepted: a count"),  # false equalled 0
    ("nan", -1, "has nan -1; accepted: a count"),
    ("inf", None, "lacks 'inf'"),
])
def test_a_malformed_entry_is_one_line_naming_it(capsys, export_dir, tmp_path, field, value, says):
  dst = _copy(export_dir, tmp_path)

  def change(entries):
    if field in ("zero", "nan", "inf"):
      index = _first(entries, lambda e: "scale_of" in e)
    elif value == "bools":
      index = _first(entries, lambda e: e["shape"] and all(d == 1 for d in e["shape"]))
    else:
      index = 3
    if value is None:
      del entries[index][field]
    else:
      entries[index][field] = [True] * len(entries[index]["shape"]) if value == "bools" else value
    return index

  index, _ = _edit(dst, change)
  line = refused(capsys, ["verify", str(dst)], f"{dst / MANIFEST}: tensors[{index}]", says)
  assert line.startswith("error: ")


@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_manifest_that_is_not_a_regular_file_is_named_as_such(capsys, export_dir, tmp_path, kind):
  dst = _copy(export_dir, tmp_path)
  (dst / MANIFEST).unlink()
  if kind == "FIFO":
    os.mkfifo(dst / MANIFEST)
  else:
    (dst / MANIFEST).mkdir()
  says = "not a regular file (a FIFO" if kind == "FIFO" else "is a directory"
  refused(capsys, ["verify", str(dst)], f"{dst / MANIFEST}: is {'' if kind == 'FIFO' else 'a '}", says)


def test_verify_exit_codes_are_as_documented(capsys, export_dir, tmp_path):
  """docs/export.md: 1 when a stored tensor differs from its entry; 2 when the export or its manifest cannot be read
  (a shard missing: the export is incomplete, not a tensor that differs)."""
  dst = _copy(export_dir, tmp_path)
  shard = dst / "model-00001-of-00001.safetensors"
  raw = bytearray(shard.read_bytes())
  raw[-1] ^= 0x01
  shard.write_bytes(bytes(raw))
  assert cli.main(["verify", str(dst)]) == 1
  assert capsys.readouterr().out.startswith(f"FAILED: {dst}: tensor ")
  shard.unlink()
  refused(capsys, ["verify", str(dst)], "model-00001-of-00001.safetensors")


@pytest.mark.parametrize("block", [[True, True], [True, 128], [128.0, 128], [0, 128], [128], "128"])
def test_a_weight_block_size_that_is_not_two_positive_integers_is_refused(capsys, export_dir, tmp_path, block):
  """`[true, true]` was taken as 1x1 blocks, and the error then blamed a tensor's scales."""
  dst = _copy(export_dir, tmp_path)
  config = json.loads((dst / "config.json").read_text())
  config["quantization_config"]["weight_block_size"] = block
  (dst / "config.json").write_text(json.dumps(config))
  for argv in (["import", "--path", str(dst), "--output", str(tmp_path / "out")],
               ["forward", *TINY_CKPT_MODEL, "--checkpoint", str(dst)]):
    refused(capsys, argv, f"{dst}/config.json: weight_block_size ", "is not two positive integers")
  assert sorted(os.listdir(tmp_path)) == ["dst"]
