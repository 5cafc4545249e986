"""Atomic writes: files and directories appear whole or not at all; existing outputs survive failures."""

import json
import os

import pytest

from inspect_tool import errors
from inspect_tool.output import atomic
from inspect_tool.output import destination


def _umask():
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _previous_export(path):
  """A directory as an earlier export leaves it (its report names this tool as producer)."""
  path.mkdir()
  (path / "quantization_report.json").write_text(json.dumps({"producer": {"name": "inspect_checkpoint"}}))
  (path / "a").write_text("old")
  return path


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
  dst = _previous_export(tmp_path / "dst")
  with pytest.raises(RuntimeError):
    with atomic.atomic_directory(str(dst), overwrite=True) as tmp:
      open(os.path.join(tmp, "b"), "w").write("new")
      raise RuntimeError("boom")
  assert sorted(os.listdir(dst)) == ["a", "quantization_report.json"] and sorted(os.listdir(tmp_path)) == ["dst"]
  with atomic.atomic_directory(str(dst), overwrite=True) as tmp:
    open(os.path.join(tmp, "b"), "w").write("new")
  assert os.listdir(dst) == ["b"] and sorted(os.listdir(tmp_path)) == ["dst"]


def test_directory_that_appears_meanwhile_is_never_replaced_without_overwrite(tmp_path):
  dst = tmp_path / "dst"
  with pytest.raises(errors.InputError, match="already exists; pass --overwrite"):
    with atomic.atomic_directory(str(dst)) as tmp:
      open(os.path.join(tmp, "b"), "w").write("new")
      dst.mkdir()  # somebody else's directory, created while we worked (empty: rename(2) alone would replace it)
  assert os.listdir(dst) == [] and sorted(os.listdir(tmp_path)) == ["dst"]


def test_overwrite_at_the_swap_refuses_a_directory_that_became_foreign(tmp_path):
  dst = _previous_export(tmp_path / "dst")
  with pytest.raises(errors.InputError, match="not a checkpoint"):
    with atomic.atomic_directory(str(dst), overwrite=True) as tmp:
      open(os.path.join(tmp, "b"), "w").write("new")
      os.unlink(dst / "quantization_report.json")  # replaced meanwhile by a user's directory
  assert os.listdir(dst) == ["a"] and sorted(os.listdir(tmp_path)) == ["dst"]


@pytest.mark.parametrize("fail_second_rename", [False, True])
def test_fallback_swap_without_renameat2_puts_the_previous_directory_back(tmp_path, monkeypatch,
                                                                           fail_second_rename):
  monkeypatch.setenv(atomic.FALLBACK_ENV, "1")
  dst = _previous_export(tmp_path / "dst")
  real_rename, calls = os.rename, []

  def rename(src, target):
    calls.append((src, target))
    if fail_second_rename and len(calls) == 2:
      raise OSError(28, "No space left on device", target)
    return real_rename(src, target)

  monkeypatch.setattr(atomic.os, "rename", rename)
  if fail_second_rename:
    with pytest.raises(errors.InputError, match="no space left on device"):
      with atomic.atomic_directory(str(dst), overwrite=True) as tmp:
        open(os.path.join(tmp, "b"), "w").write("new")
    assert sorted(os.listdir(dst)) == ["a", "quantization_report.json"]
  else:
    with atomic.atomic_directory(str(dst), overwrite=True) as tmp:
      open(os.path.join(tmp, "b"), "w").write("new")
    assert os.listdir(dst) == ["b"]
  assert sorted(os.listdir(tmp_path)) == ["dst"] and len(calls) >= 2


def test_temporary_directory_carries_the_marker_until_complete(tmp_path):
  dst = tmp_path / "dst"
  with atomic.atomic_directory(str(dst)) as tmp:
    assert os.path.basename(tmp).startswith(f".dst.tmp-{os.getpid()}-")
    assert os.path.exists(os.path.join(tmp, destination.TMP_MARKER))
  assert os.listdir(dst) == []


def test_io_error_reading_a_source_names_the_source_not_the_output(tmp_path):
  source = tmp_path / "src" / "chunk"
  with pytest.raises(errors.InputError) as info:
    with atomic.atomic_directory(str(tmp_path / "dst")):
      raise PermissionError(13, "Permission denied", str(source))
  assert str(info.value) == f"cannot read {str(source)!r}: Permission denied"
  assert sorted(os.listdir(tmp_path)) == []
