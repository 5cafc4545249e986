"""Fuzz-style: truncated and garbled copies of the reference checkpoint's files and of a safetensors file.

Each damaged copy goes to the commands that read it (`orbax`, `diff`, `forward`; `hf` for safetensors). Every
run must end with exit 2 and one stderr line naming the damaged checkpoint or file (no traceback, nothing on
stdout, nothing written), within a few seconds; commands that never read the damaged file must still succeed.
The damage is drawn from a seeded generator, so every run of the suite tries the same cases. In-process runs
are guarded by `faulthandler` (a hang aborts the run with a traceback instead of blocking the suite).
"""

import faulthandler
import json
import os
import random
import shutil
import struct
import sys

import numpy as np
import pytest

from conftest import run_cli

from hostile import REF_CKPT, TINY_CKPT_MODEL, check_one_line

SEED = 13
HANG_SECONDS = 120  # far above any case (a few seconds each): only a hang reaches it
ITEMS = os.path.join("0", "items")
# Files of the reference checkpoint and who reads them: the tree metadata and the top-level OCDBT manifest and
# B-tree node (which hold the zarr headers) every command; the array data file and Orbax's array metadata only
# `forward`, which restores the arrays. (The per-process OCDBT manifest and B-tree nodes under ocdbt.process_0
# are left from before Orbax merged the databases: the top-level B-tree points into the data file directly, and
# no command reads them.)
METADATA_FILES = ["_METADATA", "manifest.ocdbt", "d/333d5e1e224d68981463e67c8f560a68"]
DATA_FILES = ["ocdbt.process_0/d/6f0242f7759330b692ac0a0b25814c14", "array_metadatas/process_0"]
# Garbling is only tried on files with a structure or checksum that must reveal it (JSON, OCDBT manifests and
# B-tree nodes); array data is stored without checksums, so altered values there would load as other values.
GARBLE_FILES = METADATA_FILES


def _truncations(size: int, rng: random.Random) -> list[int]:
  return sorted({0, size // 2, rng.randrange(1, size - 1)})


def _garble(data: bytes, rng: random.Random) -> bytes:
  out = bytearray(data)
  for _ in range(8):
    out[rng.randrange(len(out))] ^= rng.randrange(1, 256)
  return bytes(out)


def _cases():
  rng = random.Random(SEED)
  cases = []
  for relative in METADATA_FILES + DATA_FILES:
    size = os.path.getsize(os.path.join(REF_CKPT, ITEMS, relative))
    cases += [(relative, f"truncate:{n}") for n in _truncations(size, rng)]
    if relative in GARBLE_FILES:
      cases.append((relative, f"garble:{rng.randrange(2**31)}"))
  return cases


def _damage(path: str, how: str) -> None:
  kind, value = how.split(":")
  if kind == "truncate":
    os.truncate(path, int(value))
  else:
    with open(path, "rb") as f:
      data = f.read()
    with open(path, "wb") as f:
      f.write(_garble(data, random.Random(int(value))))


def _run(capsys, argv) -> tuple[int, str, str]:
  faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=sys.__stderr__)
  try:
    return run_cli(capsys, *argv)
  finally:
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("relative, how", _cases())
def test_damaged_checkpoint_file(capsys, tmp_path, monkeypatch, relative, how):
  ckpt = tmp_path / "ckpt"
  shutil.copytree(REF_CKPT, ckpt)
  _damage(os.path.join(ckpt, ITEMS, relative), how)
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  monkeypatch.chdir(tmp_path)
  reads = relative in METADATA_FILES
  commands = {"orbax": ["orbax", "--path", ckpt], "diff": ["diff", *TINY_CKPT_MODEL, "--path", ckpt],
              "forward": ["forward", *TINY_CKPT_MODEL, "--checkpoint", ckpt]}
  for name, argv in commands.items():
    code, out, err = _run(capsys, argv)
    if reads or name == "forward":
      check_one_line(code, out, err, str(ckpt))
    else:
      assert code == 0 and "Traceback" not in err, (name, code, err[-2000:])
  assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing written


def _safetensors_file(path) -> bytes:
  rng = np.random.default_rng(SEED)
  tensors = {"model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(np.float32),
             "model.layers.0.mlp.gate.weight": rng.standard_normal((4, 4)).astype(np.float16),
             "lm_head.weight": rng.integers(0, 255, (4, 8), dtype=np.uint8)}
  header, chunks, offset = {}, [], 0
  for name, array in tensors.items():
    raw = array.tobytes()
    dtype = {"float32": "F32", "float16": "F16", "uint8": "U8"}[array.dtype.name]
    header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
    chunks.append(raw)
    offset += len(raw)
  text = json.dumps(header).encode()
  data = struct.pack("<Q", len(text)) + text + b"".join(chunks)
  path.write_bytes(data)
  return data


def _safetensors_cases():
  rng = random.Random(SEED + 1)
  cases = [f"truncate:{n}" for n in sorted({0, 7, 8, 20, rng.randrange(9, 200), rng.randrange(200, 400)})]
  cases += [f"structure:{rng.randrange(2**31)}" for _ in range(4)]
  return cases


@pytest.mark.parametrize("how", _safetensors_cases())
def test_damaged_safetensors_file(capsys, tmp_path, monkeypatch, how):
  path = tmp_path / "model.safetensors"
  data = _safetensors_file(path)
  kind, value = how.split(":")
  if kind == "truncate":
    path.write_bytes(data[:int(value)])
  else:  # a JSON structural character of the header replaced by a letter: never valid JSON again
    length = struct.unpack("<Q", data[:8])[0]
    rng = random.Random(int(value))
    spots = [i for i in range(8, 8 + length) if chr(data[i]) in '{}[]:,"']
    spot = rng.choice(spots)
    path.write_bytes(data[:spot] + b"x" + data[spot + 1:])
  monkeypatch.chdir(tmp_path)
  code, out, err = _run(capsys, ["hf", "--path", path])
  check_one_line(code, out, err, str(path))
  code, out, err = _run(capsys, ["diff", *TINY_CKPT_MODEL, "--path", path])
  check_one_line(code, out, err, str(path))
  code, out, err = _run(capsys, ["forward", *TINY_CKPT_MODEL, "--checkpoint", path])
  check_one_line(code, out, err, str(path))
  assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_the_undamaged_copies_are_accepted(capsys, tmp_path):
  """The control: the same commands on the intact files succeed, so the failures above come from the damage."""
  path = tmp_path / "model.safetensors"
  _safetensors_file(path)
  code, out, err = _run(capsys, ["hf", "--path", path])
  assert code == 0 and "model.layers.0.mlp.gate.weight" in out, err
  code, out, err = _run(capsys, ["diff", *TINY_CKPT_MODEL, "--path", REF_CKPT])
  assert code == 0, err
