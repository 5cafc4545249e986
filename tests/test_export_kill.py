"""Killing or stopping `export` at every stage leaves no output or the previous one, and the next run cleans up.

Stages: `start` (work directory created), `arrays` (mid-write, half the arrays on disk), `written`, `report`,
`swap` (complete, just before the final rename), `swapped` (after the exchange, previous DST not yet removed) and,
on the two-rename fallback without renameat2, `swap-aside` (between its renames: DST is briefly absent).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from inspect_tool.output import atomic
from inspect_tool.fp8_export import pipeline as export

pytestmark = pytest.mark.slow  # stress: kills and stops of running exports (.ci/run: once)

from conftest import REPO
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
TOKENS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
          "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]


def _argv(dst, *extra):
  return [sys.executable, "-m", "inspect_tool", "export", *TOKENS, "--checkpoint", CKPT, "--output", str(dst),
          "--no-validate", "--quiet", *extra]  # --quiet: no progress lines beside the one error line


def _env(**extra):
  return dict(os.environ, JAX_PLATFORMS="cpu", **extra)


def _run(dst, *extra, **env):
  return subprocess.run(_argv(dst, *extra), capture_output=True, text=True, env=_env(**env), cwd=REPO, check=False,
                        timeout=300)


def _tree(root):
  out = {}
  for directory, _, files in os.walk(root):
    for name in files:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


def _previous(dst):
  """A previous export at `dst` (what --overwrite may replace)."""
  (dst / "0").mkdir(parents=True)
  (dst / "quantization_report.json").write_text(json.dumps({"producer": {"name": "inspect_checkpoint"}}))
  (dst / "0" / "data").write_bytes(b"\1\2\3")
  return _tree(dst)


def _is_new_export(dst):
  return os.path.isdir(dst / "0" / "items") and "command" in json.loads((dst / "quantization_report.json").read_text())


@pytest.mark.parametrize("point, outcome", [("start", "previous"), ("arrays", "previous"), ("written", "previous"),
                                            ("report", "previous"), ("swap", "previous"), ("swapped", "new"),
                                            ("swap-aside", "aside")])
def test_kill_at_every_stage_leaves_no_output_or_the_previous_one(tmp_path, point, outcome):
  assert point in export.KILL_POINTS
  dst = tmp_path / "dst"
  before = _previous(dst)
  env = {atomic.KILL_ENV: point}
  if point == "swap-aside":
    env[atomic.FALLBACK_ENV] = "1"
  out = _run(dst, "--overwrite", **env)
  assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
  leftovers = [n for n in os.listdir(tmp_path) if n not in ("dst", ".dst.lock")]  # a killed run keeps its lock file
  assert leftovers and all(n.startswith(".dst.tmp-") for n in leftovers)  # the kill landed mid-run
  if outcome == "previous":
    assert _tree(dst) == before
  elif outcome == "new":
    assert _is_new_export(dst)
  else:  # DST is absent between the fallback's renames; the previous one waits aside
    assert not dst.exists() and any(n.endswith(".old") for n in leftovers)
  if point in ("arrays", "swapped", "swap-aside"):  # the next run restores / reclaims, then does its work
    again = _run(dst, "--overwrite")
    assert again.returncode == 0, again.stderr[-2000:]
    assert os.listdir(tmp_path) == ["dst"] and _is_new_export(dst)


@pytest.mark.parametrize("signum, point", [(signal.SIGTERM, "arrays"), (signal.SIGHUP, "arrays"),
                                           (signal.SIGINT, "arrays"), (signal.SIGQUIT, "arrays"),
                                           (signal.SIGQUIT, "swap"), (signal.SIGTERM, "swap")])
def test_terminate_cleans_up_and_says_so_in_one_line(tmp_path, signum, point):
  dst, flag = _out_dir(tmp_path) / "dst", tmp_path / "paused"
  before = _previous(dst)
  # A shell without job control starts background jobs (CI runs the two stacks side by side) with SIGINT ignored,
  # and the child would inherit that; a Python handler here makes the child start with the default disposition.
  previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    proc = subprocess.Popen(_argv(dst, "--overwrite"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(**{atomic.PAUSE_ENV: f"{point}:{flag}"}), cwd=REPO)
  finally:
    signal.signal(signal.SIGINT, previous_handler)
  try:
    _wait_for(flag, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == (130 if signum == signal.SIGINT else 128 + signum), err
  assert len(err.strip().splitlines()) == 1 and "nothing was left half-written" in err
  assert _tree(dst) == before and os.listdir(dst.parent) == ["dst"]


def _out_dir(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  return out


def _wait_for(flag, proc, timeout=180):
  deadline = time.monotonic() + timeout
  while not flag.exists():
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    assert time.monotonic() < deadline
    time.sleep(0.05)


def test_concurrent_exports_to_one_destination(tmp_path):
  """The second export fails with one line while the first holds DST; the first then completes."""
  dst, flag = _out_dir(tmp_path) / "dst", tmp_path / "paused"
  first = subprocess.Popen(_argv(dst), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=_env(**{atomic.PAUSE_ENV: f"written:{flag}"}), cwd=REPO)
  _wait_for(flag, first)
  second = _run(dst, "--overwrite")
  assert second.returncode == 2 and "being written by another inspect_checkpoint run" in second.stderr
  assert len(second.stderr.strip().splitlines()) == 1
  flag.unlink()
  _, err = first.communicate(timeout=120)
  assert first.returncode == 0, err
  assert _is_new_export(dst) and os.listdir(dst.parent) == ["dst"]


def test_destination_created_meanwhile_is_left_alone_without_overwrite(tmp_path):
  dst, flag = _out_dir(tmp_path) / "dst", tmp_path / "paused"
  proc = subprocess.Popen(_argv(dst), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=_env(**{atomic.PAUSE_ENV: f"written:{flag}"}), cwd=REPO)
  _wait_for(flag, proc)
  dst.mkdir()
  (dst / "mine.txt").write_text("created by someone else")
  flag.unlink()
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 2 and "already exists; pass --overwrite" in err and len(err.strip().splitlines()) == 1
  assert _tree(dst) == {"mine.txt": b"created by someone else"} and os.listdir(dst.parent) == ["dst"]


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path):
  """A 600 KB tmpfs (the export needs ~2 MB): one line naming DST, exit 2, nothing left on the file system."""
  mount = tmp_path / "small"
  mount.mkdir()
  subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], check=True)
  try:
    out = _run(mount / "dst")
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    assert out.stderr.startswith(f"error: cannot write '{mount / 'dst'}")
    assert out.stderr.strip().endswith("': no space left on device")
    assert os.listdir(mount) == []
  finally:
    subprocess.run(["umount", str(mount)], check=False)
