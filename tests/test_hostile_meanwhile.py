"""DST created by someone else while a run without --overwrite works on it (written as the careless colleague would:
`mkdir DST` and a file of theirs, mid-run): the run ends in one line, exit 2, without touching their DST and with
nothing of its own left beside it. No --quiet: the progress of the work before (validation included) is no line
of the refusal in a pipe.

Local runs (Orbax export with validation, deepseek-fp8 export, import) are paused at the point just before DST
would appear (`swap`); gs:// runs, where no rename can refuse for us, at `staged` (the work done, before DST is
checked) and at `publishing` (a new DST: checked once, its marker not yet written; a replaced one: half of the
staged objects copied).
"""

import os
import subprocess
import sys

import pytest

from gcs_emulator import BUCKET
from hostile import without_progress
from inspect_tool.output import atomic
from test_export_kill import CKPT, REPO, TOKENS, _env, _wait_for
from test_gcs_safe_writes import _previous

pytestmark = pytest.mark.slow  # stress: runs raced by a second writer of the same destination (.ci/run: once)



def _runs(dst):
  export = [sys.executable, "-m", "inspect_tool", "export", *TOKENS, "--checkpoint", CKPT, "--output", str(dst)]
  return {"export (orbax, validated)": export, "export --layout deepseek-fp8": export + ["--layout", "deepseek-fp8"]}


def _theirs(dst):
  os.mkdir(dst)
  with open(os.path.join(dst, "theirs.txt"), "w", encoding="utf-8") as f:
    f.write("not yours\n")


def _meanwhile(argv, tmp_path, point, make_theirs, env=None):
  flag = tmp_path / "paused"
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                          env=dict(env or _env(), **{atomic.PAUSE_ENV: f"{point}:{flag}"}))
  try:
    _wait_for(flag, proc)
    make_theirs()
    flag.unlink()
    out, err = proc.communicate(timeout=300)
  finally:
    proc.kill()
  return proc.returncode, out, err


@pytest.mark.parametrize("run", ["export (orbax, validated)", "export --layout deepseek-fp8", "import"])
def test_a_local_dst_created_meanwhile_is_refused_in_one_line_and_left_as_it_is(tmp_path, run):
  out_dir = tmp_path / "out"
  out_dir.mkdir()
  dst = out_dir / "dst"
  if run == "import":
    source = tmp_path / "release"
    subprocess.run(_runs(source)["export --layout deepseek-fp8"] + ["--no-validate", "--quiet"], check=True,
                   env=_env(), cwd=REPO, capture_output=True)
    argv = [sys.executable, "-m", "inspect_tool", "import", "--path", str(source), "--output", str(dst)]
  else:
    argv = _runs(dst)[run]
  code, out, err = _meanwhile(argv, tmp_path, "swap", lambda: _theirs(dst))
  assert (code, out, without_progress(err)) == (
      2, "", f"error: output '{dst}' already exists; pass --overwrite to replace it\n")
  assert os.listdir(dst) == ["theirs.txt"] and (dst / "theirs.txt").read_text() == "not yours\n"
  assert os.listdir(out_dir) == ["dst"]  # no temporary directory, no lock


def _tool_lines(err: str) -> list[str]:
  """stderr without the INFO line tensorstore logs when it uses the emulator's test token (not the tool's)."""
  return [line for line in without_progress(err).splitlines() if "google_auth_provider.cc" not in line]


@pytest.mark.parametrize("point,replacing", [("staged", False), ("publishing", False), ("publishing", True)])
def test_a_gs_dst_written_meanwhile_is_refused_in_one_line_and_only_theirs_is_left(gcs, tmp_path, point, replacing):
  """A new DST is written in place (its objects checked at `staged` and again at `publishing`, before the marker);
  one replaced with --overwrite is published from the staging prefix (`publishing`: half of ours copied)."""
  where = f"meanwhile-{point}-{'replacing' if replacing else 'new'}"
  dst = f"gs://{BUCKET}/{where}/dst"
  local = tmp_path / "tmp"
  local.mkdir()
  theirs = tmp_path / "theirs"
  theirs.mkdir()
  (theirs / "theirs.txt").write_text("not yours\n")
  argv = _runs(dst)["export (orbax, validated)"]
  if replacing:
    _previous(gcs, tmp_path, dst)
    argv = argv + ["--overwrite"]
  code, out, err = _meanwhile(argv, tmp_path, point, lambda: gcs.upload(theirs, dst), env=_env(TMPDIR=str(local)))
  lines = _tool_lines(err)
  assert code == 2 and out == "" and len(lines) == 1, err
  verb = "published" if replacing else "wrote"
  assert lines[0].startswith(f"error: output '{dst}' was written by someone else while this run {verb} it (1 "
                             "object(s) not ours, e.g. 'theirs.txt'); theirs are left as they are and ours removed")
  assert gcs.listing(f"gs://{BUCKET}/{where}") == ["dst/theirs.txt"]  # no staging prefix, no lock
  assert os.listdir(local) == []
