"""Atomic writes: files and directories appear whole or not at all; existing outputs survive failures."""

import os

import pytest

from inspect_tool import atomic, errors


def _umask():
  mask = os.umask(0)
  os.umask(mask)
  return mask


def test_write_text_replaces_whole_file(tmp_path):
  path = tmp_path / "out.txt"
  atomic.atomic_write_text(str(path), "one")
  atomic.atomic_write_text(str(path), "two")
  assert path.read_text() == "two" and os.listdir(tmp_path) == ["out.txt"]
  assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()


def test_write_into_missing_directory_is_one_line_error(tmp_path):
  with pytest.raises(errors.InputError, match="cannot write"):
    atomic.atomic_write_text(str(tmp_path / "nope" / "out.txt"), "x")


def test_directory_refuses_existing_without_overwrite(tmp_path):
  dst = tmp_path / "dst"
  dst.mkdir()
  with pytest.raises(errors.InputError, match="--overwrite"):
    with atomic.atomic_directory(str(dst)):
      pass


def test_failed_overwrite_keeps_previous_directory(tmp_path):
  dst = tmp_path / "dst"
  with atomic.atomic_directory(str(dst)) as tmp:
    (open(os.path.join(tmp, "a"), "w")).write("old")
  with pytest.raises(RuntimeError):
    with atomic.atomic_directory(str(dst), overwrite=True) as tmp:
      open(os.path.join(tmp, "b"), "w").write("new")
      raise RuntimeError("boom")
  assert os.listdir(dst) == ["a"] and sorted(os.listdir(tmp_path)) == ["dst"]
  with atomic.atomic_directory(str(dst), overwrite=True) as tmp:
    open(os.path.join(tmp, "b"), "w").write("new")
  assert os.listdir(dst) == ["b"] and sorted(os.listdir(tmp_path)) == ["dst"]
