"""Helpers of the hostile-input tests: run the CLI and require exit 2 with one line on stderr."""

import os
import re
import subprocess
import sys

from inspect_tool import cli

from conftest import REPO
REF_CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
# The reference checkpoint's model (MaxText's deepseek3-tiny with 4 layers, 1 dense, vocab 1024, one MTP layer).
TINY_CKPT_MODEL = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true",
                   "base_num_decoder_layers=4", "first_num_dense_layers=1", "vocab_size=1024"]


# The lines `progress` prints off a terminal for work that took `PLAIN_AFTER_SECONDS` (a loaded machine's
# validation passes): a finished step ("validation 2/3: ...… 12.3s") and a byte progress's quarters and end.
_PROGRESS = re.compile(r".*… \d+\.\ds|.+: (25|50|75|100)% \(\d+/\d+ arrays, .*|.+: done, \d+ arrays, .*")


def without_progress(err: str) -> str:
  """`err` without the progress lines of long work before a run's end (they are no line of its refusal)."""
  return "".join(line for line in err.splitlines(keepends=True) if not _PROGRESS.fullmatch(line.rstrip("\n")))


def check_one_line(code: int, out: str, err: str, *expected: str) -> str:
  """Exit 2, nothing on stdout, exactly one stderr line holding every `expected` text, no traceback."""
  lines = err.strip().splitlines()
  assert code == 2, (code, err[-2000:])
  assert out == "", out[-500:]
  assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
  for text in expected:
    assert text in lines[0], (text, lines[0])
  return lines[0]


def refused(capsys, argv, *expected: str) -> str:
  """Runs `inspect_checkpoint argv` in-process; returns the one error line (see `check_one_line`)."""
  code = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return check_one_line(code, out, err, *expected)


def refused_in_subprocess(argv, *expected: str, timeout: float = 120, cwd: str | None = None) -> str:
  """As `refused`, in a child process killed after `timeout` s (for inputs that could block a read)."""
  result = subprocess.run([sys.executable, "-m", "inspect_tool", *[str(a) for a in argv]], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or REPO, check=False)
  return check_one_line(result.returncode, result.stdout, result.stderr, *expected)


def deny_reading(monkeypatch, path: str) -> None:
  """Makes `path` (and what lies under it) unreadable: chmod when not root, else PermissionError from os calls."""
  path = os.path.abspath(path)
  if os.geteuid() != 0:
    os.chmod(path, 0)
    return

  def guarded(real, itself: bool):
    def call(target, *args, **kwargs):
      text = os.path.abspath(os.fsdecode(target)) if isinstance(target, (str, bytes, os.PathLike)) else ""
      if (itself and text == path) or text.startswith(path + os.sep):
        raise PermissionError(13, "Permission denied", text)
      return real(target, *args, **kwargs)
    return call

  # As with mode 000: the path itself can be stat'ed, but not opened or listed, and nothing under it reached.
  monkeypatch.setattr(os, "stat", guarded(os.stat, itself=False))
  for name in ("listdir", "scandir"):
    monkeypatch.setattr(os, name, guarded(getattr(os, name), itself=True))
  import builtins  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(builtins, "open", guarded(builtins.open, itself=True))
