"""Permissions, tried as a careless user has them: a umask that takes the owner's permissions (0777), and
`--overwrite` of a read-only previous export, ours or someone else's. Each run drops the capabilities that let
root ignore permissions (`setpriv`: no CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER), as an ordinary user
runs. Each ends in one line or succeeds, with nothing left beside DST and the previous DST intact when refused.
"""

import os
import shutil
import stat
import subprocess
import sys

import pytest

from test_export_kill import CKPT, REPO, TOKENS, _env

NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--inh-caps=-all"]


def _run(argv, umask=None, **env):
  def preexec():
    if umask is not None:
      os.umask(umask)
  return subprocess.run(NO_DAC + argv, capture_output=True, text=True, cwd=REPO, env=_env(**env), timeout=300,
                        preexec_fn=preexec, check=False)


def _export(dst, *extra):
  return [sys.executable, "-m", "inspect_tool", "export", *TOKENS, "--checkpoint", CKPT, "--output", str(dst), *extra]


def _previous(path):
  """A previous export of this tool at `path` (copied from a fresh one), every file and directory read-only."""
  made = subprocess.run(_export(path, "--no-validate", "--quiet"), capture_output=True, text=True, cwd=REPO,
                        env=_env(), check=False)
  assert made.returncode == 0, made.stderr
  for directory, dirs, files in os.walk(path):
    for name in files + dirs:
      os.chmod(os.path.join(directory, name), stat.S_IMODE(os.lstat(os.path.join(directory, name)).st_mode) & ~0o222)
  os.chmod(path, 0o555)
  return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


@pytest.mark.parametrize("layout", ["orbax", "deepseek-fp8", "import"])
def test_a_umask_that_takes_the_owners_permissions_is_one_line_and_writes_nothing(tmp_path, layout):
  out = tmp_path / "out"
  out.mkdir()
  dst, cache = out / "dst", tmp_path / "cache"
  if layout == "import":
    source = tmp_path / "release"
    subprocess.run(_export(source, "--layout", "deepseek-fp8", "--no-validate", "--quiet"), check=True,
                   cwd=REPO, env=_env(), capture_output=True)
    argv = [sys.executable, "-m", "inspect_tool", "import", "--path", str(source), "--output", str(dst)]
  else:
    argv = _export(dst, "--layout", layout)
  done = _run(argv, umask=0o777, XDG_CACHE_HOME=str(cache))
  assert done.returncode == 2 and done.stdout == "", done.stderr
  assert done.stderr == (f"error: umask 0777 takes the owner's permissions from what this run writes, so '{dst}' "
                         "could not be written or read back; accepted: a umask that leaves the owner rwx, e.g. 0022 "
                         "or 0077\n")
  assert os.listdir(out) == [] and not cache.exists()  # no temporary directory, no compilation cache made


def test_overwrite_of_a_read_only_previous_export_of_ours_replaces_it_and_leaves_nothing(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  dst = out / "dst"
  _previous(dst)
  done = _run(_export(dst, "--overwrite", "--quiet"))  # --quiet: a loaded machine's slow validation prints no progress
  assert done.returncode == 0 and done.stderr == "", done.stderr
  assert os.listdir(out) == ["dst"] and (dst / "quantization_report.json").stat().st_mode & 0o200


def test_overwrite_of_a_read_only_previous_export_not_ours_is_one_line_and_leaves_it(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  dst = out / "dst"
  before = _previous(dst)
  for directory, dirs, files in os.walk(dst):
    for name in dirs + files:
      os.lchown(os.path.join(directory, name), 65534, 65534)  # nobody's
  os.lchown(dst, 65534, 65534)
  try:
    done = _run(_export(dst, "--overwrite"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"error: cannot replace '{dst}': '{dst}' is not writable and not yours, so the previous "
                           "output could not be removed; accepted: --output of a directory you can remove, or make "
                           "it writable first\n")
    assert os.listdir(out) == ["dst"]
    assert sorted(os.path.relpath(os.path.join(d, n), dst) for d, ds, fs in os.walk(dst) for n in ds + fs) == before
  finally:
    for directory, _, _ in os.walk(dst):
      os.chmod(directory, 0o755)
    shutil.rmtree(dst)
