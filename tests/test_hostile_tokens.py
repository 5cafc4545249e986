"""Hostile --tokens / --targets files: checked before any array memory is allocated (issue 13, item 6)."""

import os

import numpy as np
import pytest

from hostile import deny_reading, refused, refused_in_subprocess

MODEL = ["forward", "model_name=deepseek3-tiny"]


def _npy_claiming(path, shape, dtype="<i4", data: bytes = bytes(64)) -> str:
  """A .npy file whose header claims `shape` but holds only `data`."""
  with open(path, "wb") as f:
    np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": shape})
    f.write(data)
  return str(path)


@pytest.mark.parametrize("shape", [(100_000, 100_000), (1_000_000, 1_000_000), (10**6, 10**6, 10**6)])
@pytest.mark.parametrize("option", ["--tokens", "--targets"])
def test_header_claiming_more_than_the_file_holds(capsys, tmp_path, shape, option):
  path = _npy_claiming(tmp_path / "t.npy", shape)
  what = option.strip("-")
  refused(capsys, [*MODEL, option, path], f"{what} file {path!r}: its header claims shape {shape}",
          f"({np.prod(shape, dtype=object)} elements of int32), but the file holds only 64 data bytes")


@pytest.mark.parametrize("content, expected", [
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': 'zz'}\n", "has a corrupt .npy header"),
    (b"\x93NUMPY\x09\x00", "has a corrupt .npy header"),
    (b"not numpy at all", "is not a .npy array (no NumPy header)"),
])
def test_corrupt_header(capsys, tmp_path, content, expected):
  path = tmp_path / "t.npy"
  path.write_bytes(content)
  refused(capsys, [*MODEL, "--tokens", path], expected)


def test_object_array_is_refused_without_unpickling(capsys, tmp_path):
  path = _npy_claiming(tmp_path / "t.npy", (2, 2), dtype="|O")
  refused(capsys, [*MODEL, "--tokens", path], "holds Python objects; expected an integer array")


def test_unreadable_tokens(capsys, tmp_path, monkeypatch):
  path = tmp_path / "t.npy"
  np.save(path, np.zeros((2, 16), np.int32))
  deny_reading(monkeypatch, str(path))
  refused(capsys, [*MODEL, "--tokens", path], f"tokens file {str(path)!r} cannot be read: Permission denied")


def test_directory_is_a_directory(capsys, tmp_path):
  refused(capsys, [*MODEL, "--tokens", tmp_path], f"tokens file {str(tmp_path)!r} is a directory")


def test_missing_file_does_not_exist(capsys, tmp_path):
  refused(capsys, [*MODEL, "--tokens", tmp_path / "none.npy"], "does not exist")


def test_fifo_is_not_a_regular_file(tmp_path):
  fifo = tmp_path / "t.npy"
  os.mkfifo(fifo)
  refused_in_subprocess([*MODEL, "--tokens", fifo], "is not a regular file (FIFO, socket or device)", timeout=60)
