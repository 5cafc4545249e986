"""One rule for every writer (`--output_file`, `--html`, `--save-logits`, export directories and their reports):
atomic, never replacing a device, FIFO, socket, directory or symbolic link, sibling names within 255 bytes, and
stdout failures or a deleted working directory as one line (exit 2)."""

import os
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest

from inspect_tool import errors
from inspect_tool.output import atomic
from inspect_tool.output import destination

from conftest import REPO
from conftest import run_cli
TINY = ["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=2",
        "first_num_dense_layers=1", "vocab_size=256"]
WRITERS = {  # writer: the command line writing PATH
    "maxtext --output_file": ["maxtext", "model_name=deepseek3-tiny", "--output_file"],
    "maxtext --html": ["maxtext", "model_name=deepseek3-tiny", "--html"],
    "keys --output_file": ["keys", "--output_file"],
    "forward --save-logits": ["forward", *TINY, "--save-logits"],
}
LONG = "n" * 246 + ".txt"  # a legal 250-byte name


def _run(capsys, argv):
  return run_cli(capsys, *argv)


def _one_line(code, err):
  assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (code, err)


def _kind(path):
  return stat.S_IFMT(os.lstat(path).st_mode)


def _special(tmp_path, kind):
  """A path of `kind` that no writer may replace (a character device needs no privilege: /dev/null itself)."""
  if kind == "character device":
    return "/dev/null"
  path = str(tmp_path / kind.replace(" ", "_"))
  if kind == "FIFO":
    os.mkfifo(path)
  elif kind == "directory":
    os.mkdir(path)
    with open(os.path.join(path, "keep"), "w", encoding="utf-8") as f:
      f.write("mine")
  elif kind == "socket":  # bound by a relative name: AF_UNIX paths are limited to 108 bytes
    cwd, sock = os.getcwd(), socket.socket(socket.AF_UNIX)
    os.chdir(tmp_path)
    try:
      sock.bind(os.path.basename(path))
    finally:
      os.chdir(cwd)
      sock.close()
  return path


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("kind", ["character device", "FIFO", "directory", "socket"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_no_writer_replaces_a_device_fifo_socket_or_directory(tmp_path, capsys, writer, kind, overwrite):
  path = _special(tmp_path, kind)
  before = _kind(path)
  code, out, err = _run(capsys, [*WRITERS[writer], path, *(["--overwrite"] if overwrite else [])])
  _one_line(code, err)
  assert f"is a {kind}" in err and repr(path) in err and out == ""
  assert _kind(path) == before
  assert sorted(os.listdir(tmp_path)) == ([] if path == "/dev/null" else [os.path.basename(path)])


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("target_kind", ["file", "missing", "character device"])
def test_a_symbolic_link_is_refused_naming_its_target(tmp_path, capsys, writer, target_kind):
  target = {"file": str(tmp_path / "real.txt"), "missing": str(tmp_path / "nowhere"),
            "character device": "/dev/null"}[target_kind]
  if target_kind == "file":
    with open(target, "w", encoding="utf-8") as f:
      f.write("previous")
  link = tmp_path / "link.out"
  link.symlink_to(target)
  code, out, err = _run(capsys, [*WRITERS[writer], str(link), "--overwrite"])
  _one_line(code, err)
  assert "is a symbolic link" in err and repr(target) in err and out == ""
  assert os.readlink(link) == target
  if target_kind == "file":
    assert open(target, encoding="utf-8").read() == "previous"
  assert not os.path.exists(tmp_path / "nowhere") and stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_250_byte_name_is_written_and_no_sibling_is_left(tmp_path, capsys, writer):
  path = tmp_path / LONG
  code, _, err = _run(capsys, [*WRITERS[writer], str(path)])
  assert code == 0, err
  assert os.listdir(tmp_path) == [LONG] and path.stat().st_size > 0
  if writer.startswith("forward"):
    assert np.load(path)["logits"].shape[-1] == 256
  path.write_text("previous")
  assert _run(capsys, [*WRITERS[writer], str(path), "--overwrite"])[0] == 0
  assert path.read_text(errors="replace") != "previous" and os.listdir(tmp_path) == [LONG]


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_deleted_working_directory_is_one_line(tmp_path, capsys, monkeypatch, writer):
  gone = tmp_path / "gone"
  gone.mkdir()
  monkeypatch.chdir(gone)
  gone.rmdir()
  code, out, err = _run(capsys, [*WRITERS[writer], "out.txt"])
  _one_line(code, err)
  assert "'out.txt'" in err and "working directory no longer exists" in err and out == ""
  assert os.listdir(tmp_path) == []


def test_sibling_names_fit_255_bytes_and_stay_distinct():
  names = [LONG, "é" * 125, "n" * 255, "n" * 254 + "m", "short"]
  stems = [destination.sibling_stem(name) for name in names]
  assert stems[-1] == "short" and len(set(stems)) == len(stems)
  for stem in stems:
    longest = os.fsencode(f".{stem}.tmp-{4194304}-abcdefgh.old")  # pid_max, mkdtemp's 8 characters
    assert len(longest) <= 255 and len(os.fsencode(f".{stem}.lock")) <= 255
    os.fsdecode(os.fsencode(stem))  # a whole name: no character cut in half


def test_export_directory_with_a_250_byte_name_locks_writes_and_reclaims(tmp_path):
  dst = str(tmp_path / LONG)
  with destination.claim(dst):
    with atomic.atomic_directory(dst) as tmp:
      assert len(os.path.basename(tmp)) <= 255
      assert os.path.exists(destination.lock_path(dst))
      atomic.atomic_write_text(os.path.join(tmp, "quantization_report.json"), '{"producer": "inspect_checkpoint"}')
  assert os.listdir(tmp_path) == [LONG] and os.listdir(dst) == ["quantization_report.json"]


def _cli(argv, **kwargs):
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "inspect_tool", *argv], env=env, stderr=subprocess.PIPE, text=True,
                        check=False, **kwargs)


@pytest.mark.parametrize("argv", [["maxtext", "model_name=deepseek3-tiny"], ["keys"], ["--help"],
                                  ["maxtext", "--help"]])
def test_stdout_on_a_full_disk_is_one_line(argv):
  with open("/dev/full", "w", encoding="utf-8") as full:
    proc = _cli(argv, stdout=full)
  _one_line(proc.returncode, proc.stderr)
  assert proc.stderr == "error: cannot write to standard output: no space left on device\n"


@pytest.mark.parametrize("argv", [["maxtext", "model_name=deepseek3-tiny"], ["keys"]])
def test_stdout_closed_by_its_reader_is_one_line(argv):
  read, write = os.pipe()
  os.close(read)  # the reader is gone before the first byte
  try:
    proc = _cli(argv, stdout=write)
  finally:
    os.close(write)
  _one_line(proc.returncode, proc.stderr)
  assert proc.stderr == "error: cannot write to standard output: the reader closed the pipe\n"


def test_a_file_that_appears_during_the_write_is_kept_without_overwrite(tmp_path, monkeypatch):
  path = tmp_path / "out.txt"
  real_check = destination.check_output_file
  calls = []

  def check_then_appear(p, overwrite):  # the second check passes, then another program creates the file
    result = real_check(p, overwrite)
    calls.append(p)
    if len(calls) == 2:
      path.write_text("theirs")
    return result

  monkeypatch.setattr(destination, "check_output_file", check_then_appear)
  for fallback in ("", "1"):
    monkeypatch.setenv(atomic.FALLBACK_ENV, fallback)
    calls.clear()
    path.unlink(missing_ok=True)
    with pytest.raises(errors.InputError, match="already exists; pass --overwrite"):
      atomic.atomic_write_text(str(path), "ours", overwrite=False)
    assert path.read_text() == "theirs" and os.listdir(tmp_path) == ["out.txt"]


@pytest.fixture
def full_disk(tmp_path):
  """A 64 KiB tmpfs whose every data block is taken: empty files can still be created, no byte written."""
  mount = tmp_path / "full"
  mount.mkdir()
  subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
  try:
    with open(mount / "filler", "wb", buffering=0) as f:
      with pytest.raises(OSError):
        while True:
          f.write(b"\0" * 512)
    yield mount
  finally:
    subprocess.run(["umount", str(mount)], check=False)


def test_a_completely_full_disk_leaves_no_lock_and_no_temporary(full_disk):
  dst = str(full_disk / "dst")
  with pytest.raises(errors.InputError, match=f"cannot write '{dst}': no space left on device"):
    with destination.claim(dst):
      with atomic.atomic_directory(dst) as tmp:
        atomic.atomic_write_text(os.path.join(tmp, "quantization_report.json"), "{}")
  assert os.listdir(full_disk) == ["filler"]
  with pytest.raises(errors.InputError, match=f"cannot write '{full_disk / 'out.txt'}': no space left on device"):
    atomic.atomic_write_text(str(full_disk / "out.txt"), "x" * 100000)
  assert os.listdir(full_disk) == ["filler"]


def test_main_on_a_full_disk_is_one_line_and_leaves_nothing(full_disk, capsys):
  for argv in (["keys", "--output_file", str(full_disk / "keys.txt")],
               ["export", *TINY, "quantization=fp8_full", "--random-init", "--no-validate", "--output",
                str(full_disk / "dst")]):
    code, _, err = _run(capsys, argv)
    _one_line(code, err)
    assert "no space left on device" in err and os.listdir(full_disk) == ["filler"]
