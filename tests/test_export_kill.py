"""Killing `export` (SIGKILL, at named points from the first byte written to just before the final rename) leaves
either no output or the previous output intact."""

import os
import signal
import subprocess
import sys

import pytest

from inspect_tool import export

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
TOKENS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
          "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]


def _export_killed_at(point, dst):
  env = dict(os.environ, **{export.KILL_ENV: point}, JAX_PLATFORMS="cpu")
  argv = [sys.executable, "-m", "inspect_tool", "export", *TOKENS, "--checkpoint", CKPT, "--output", str(dst),
          "--overwrite", "--no-validate"]
  return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, check=False)


def _tree(root):
  out = {}
  for directory, _, files in os.walk(root):
    for name in files:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


@pytest.mark.parametrize("point, previous", [("arrays", False), ("written", True), ("report", True)])
def test_kill_leaves_no_output_or_the_previous_one(tmp_path, point, previous):
  assert point in export.KILL_POINTS
  dst = tmp_path / "dst"
  if previous:
    (dst / "0").mkdir(parents=True)
    (dst / "marker").write_text("previous export")
    (dst / "0" / "data").write_bytes(b"\1\2\3")
    before = _tree(dst)
  out = _export_killed_at(point, dst)
  assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
  if previous:
    assert _tree(dst) == before
  else:
    assert not dst.exists()
  leftovers = [n for n in os.listdir(tmp_path) if n != "dst"]
  assert all(n.startswith(".dst.tmp-") for n in leftovers)  # only the hidden work directory can remain
  assert leftovers and os.listdir(tmp_path / leftovers[0])  # the kill did land mid-export, with data written
