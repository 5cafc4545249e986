"""Safe writes to gs:// (inspect_tool/output/object_store.py) against the local emulator: what may be replaced, what a
reader listing DST sees while an export runs, is paused, killed or stopped, and what the next run cleans up.

The export is slowed and killed with the local hooks (`atomic.PAUSE_ENV`, `atomic.KILL_ENV`) at the points of the
gs:// protocol: `arrays` (every process writing its share under the staging prefix), `staged` (the staging prefix
complete, DST not yet touched), `publishing` (DST's marker and old objects removed, half the new ones copied)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from gcs_emulator import BUCKET
from inspect_tool import cli
from inspect_tool.output import atomic
from inspect_tool.output import object_store
from inspect_tool.output import remote_lock
from inspect_tool.storage import commit
from test_export_kill import CKPT, REPO, TOKENS, _argv, _env, _wait_for

pytestmark = pytest.mark.slow  # stress: exports paused, killed, raced by readers (.ci/run: once)

_COUNT = iter(range(1_000_000))


def _dst(name: str) -> str:
  """A fresh prefix for each test (one emulator serves the session)."""
  return f"gs://{BUCKET}/safe-{next(_COUNT)}/{name}"


def _previous(gcs, tmp_path, dst: str) -> list[str]:
  """A previous, committed export at `dst` (what --overwrite may replace); its listing."""
  root = tmp_path / "previous"
  (root / "0").mkdir(parents=True)
  (root / "quantization_report.json").write_text(json.dumps({"producer": {"name": "inspect_checkpoint"}}))
  (root / "0" / "data").write_bytes(b"\1\2\3")
  (root / commit.MARKER).write_text("committed\n")
  gcs.upload(root, dst)
  return gcs.listing(dst)


def _siblings(gcs, dst: str) -> list[str]:
  """The names beside DST (its parent's listing, DST's own objects left out)."""
  parent, name = dst.rsplit("/", 1)
  return [n for n in gcs.listing(parent) if not n.startswith(name + "/")]


def _is_new_export(gcs, dst: str) -> bool:
  names = gcs.listing(dst)
  return (names[-3:] == [commit.MARKER, "export_manifest.json", "quantization_report.json"]
          and "0/items/_METADATA" in names)


def _env_tmp(tmp_path, **extra):
  local = tmp_path / "tmp"
  local.mkdir(exist_ok=True)
  return _env(TMPDIR=str(local), **extra)


def _local_leftovers(tmp_path) -> list[str]:
  """What the run left in its TMPDIR: an export to gs:// writes nothing there."""
  return os.listdir(tmp_path / "tmp")


def _export(dst, tmp_path, *extra, **env):
  return subprocess.run(_argv(dst, *extra), capture_output=True, text=True, env=_env_tmp(tmp_path, **env), cwd=REPO,
                        check=False, timeout=300)


def _one_line(err: str) -> bool:
  """The tool's one stderr line (tensorstore logs one INFO line of its own when it uses the emulator's test token:
  not the tool's, not printed against real Cloud Storage)."""
  return len([l for l in err.strip().splitlines() if "google_auth_provider.cc" not in l]) == 1


def test_what_an_export_to_gs_may_replace(gcs, tmp_path, capsys):
  dst = _dst("fp8")
  before = _previous(gcs, tmp_path, dst)

  def run(out, *extra):
    code = cli.main(["export", *TOKENS, "--checkpoint", CKPT, "--output", out, "--no-validate", *extra])
    err = capsys.readouterr().err
    assert code == 2 and _one_line(err), err
    return err

  assert f"output '{dst}' already exists; pass --overwrite to replace it" in run(dst)
  foreign = _dst("notes")
  gcs.put(foreign + "/a.txt", b"mine")
  assert "is a prefix that is not a checkpoint; --overwrite replaces only an earlier export or an Orbax " \
         "checkpoint" in run(foreign, "--overwrite")
  single = _dst("file")
  gcs.put(single, b"an object")
  assert "is an object (a file); --overwrite replaces only a checkpoint directory" in run(single, "--overwrite")
  assert "is a whole bucket; give a prefix inside it" in run(f"gs://{BUCKET}", "--overwrite")
  assert gcs.listing(dst) == before and gcs.listing(foreign) == ["a.txt"]  # nothing touched
  assert _siblings(gcs, dst) == [] and _siblings(gcs, foreign) == []  # not even a lock left


def _paused_export(dst: str, tmp_path, point: str, flag) -> subprocess.Popen:
  """An `--overwrite` export to `dst` that pauses at `point` until `flag` (which it creates then) is removed."""
  return subprocess.Popen(_argv(dst, "--overwrite"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=_env_tmp(tmp_path, **{atomic.PAUSE_ENV: f"{point}:{flag}"}), cwd=REPO)


@pytest.mark.parametrize("point", ["arrays", "staged"])
def test_a_reader_listing_dst_mid_export_sees_the_previous_export(gcs, tmp_path, point):
  dst, flag = _dst("fp8"), tmp_path / "paused"
  before = _previous(gcs, tmp_path, dst)
  proc = _paused_export(dst, tmp_path, point, flag)
  try:
    _wait_for(flag, proc)
    assert gcs.listing(dst) == before and commit.committed(dst)
    beside = _siblings(gcs, dst)
    assert ".fp8.inspect-lock" in beside  # the run's lock; at `staged`, its complete staging prefix too
    staged = [n for n in beside if n.startswith(".fp8.inspect-tmp-")]
    assert (point == "staged") == any(n.endswith("/.inspect_checkpoint-staged") for n in staged)
    flag.unlink()
    _, err = proc.communicate(timeout=240)
  finally:
    proc.kill()
  assert proc.returncode == 0, err[-2000:]
  assert _is_new_export(gcs, dst) and _siblings(gcs, dst) == [] and _local_leftovers(tmp_path) == []


def test_a_reader_refuses_dst_while_it_is_being_published(gcs, tmp_path, capsys):
  dst, flag = _dst("fp8"), tmp_path / "paused"
  _previous(gcs, tmp_path, dst)
  proc = _paused_export(dst, tmp_path, "publishing", flag)
  try:
    _wait_for(flag, proc)
    names = gcs.listing(dst)
    assert commit.MARKER not in names and "0/data" not in names and not commit.committed(dst)  # old objects gone
    code = cli.main(["orbax", "--path", dst])
    err = capsys.readouterr().err
    assert code == 2 and _one_line(err) and f"{dst}: incomplete: an inspect_checkpoint export is writing or publishing" in err
    flag.unlink()
    _, err = proc.communicate(timeout=240)
  finally:
    proc.kill()
  assert proc.returncode == 0, err[-2000:]
  assert _is_new_export(gcs, dst) and cli.main(["orbax", "--path", dst]) == 0


@pytest.mark.parametrize("point", ["arrays", "staged"])
def test_a_killed_export_leaves_the_previous_one_and_the_next_run_cleans_up(gcs, tmp_path, point):
  dst = _dst("fp8")
  before = _previous(gcs, tmp_path, dst)
  killed = _export(dst, tmp_path, "--overwrite", **{atomic.KILL_ENV: point})
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert gcs.listing(dst) == before and commit.committed(dst)
  left = _siblings(gcs, dst)
  assert ".fp8.inspect-lock" in left and all(n.startswith(".fp8.inspect-") for n in left)  # nothing like a checkpoint
  assert any(n.startswith(".fp8.inspect-tmp-") for n in left)  # the killed run's staging prefix
  assert (point == "staged") == any(n.endswith("/.inspect_checkpoint-staged") for n in left)
  assert _local_leftovers(tmp_path) == []  # written straight to gs://
  again = _export(dst, tmp_path, "--overwrite")
  assert again.returncode == 0, again.stderr[-2000:]
  assert _is_new_export(gcs, dst) and _siblings(gcs, dst) == [] and _local_leftovers(tmp_path) == []


def test_an_export_killed_while_publishing_is_completed_by_the_next_run(gcs, tmp_path, capsys):
  dst = _dst("fp8")
  _previous(gcs, tmp_path, dst)
  killed = _export(dst, tmp_path, "--overwrite", **{atomic.KILL_ENV: "publishing"})
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert commit.MARKER not in gcs.listing(dst)
  assert cli.main(["orbax", "--path", dst]) == 2 and "incomplete" in capsys.readouterr().err
  again = _export(dst, tmp_path)  # without --overwrite: completes the killed run's publication, then refuses
  assert again.returncode == 2 and _one_line(again.stderr) and "already exists" in again.stderr
  assert _is_new_export(gcs, dst) and _siblings(gcs, dst) == [] and _local_leftovers(tmp_path) == []
  assert cli.main(["orbax", "--path", dst]) == 0


def _orbax_restore(items: str):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  with ocp.PyTreeCheckpointer() as checkpointer:
    return checkpointer.restore(items)


@pytest.mark.parametrize("point", ["arrays", "staged"])
def test_a_new_dst_is_written_in_place_and_refused_to_readers_until_its_marker(gcs, tmp_path, capsys, point):
  """No previous export: the run writes DST itself (nothing copied); a reader refuses it meanwhile; a stop
  (SIGTERM, at `arrays`) removes it, lock and all; at `staged` the run goes on to publish."""
  dst, flag = _dst("fp8"), tmp_path / "paused"
  proc = _paused_export(dst, tmp_path, point, flag)
  try:
    _wait_for(flag, proc)
    names = gcs.listing(dst)
    assert "0/items/ocdbt.process_0/manifest.ocdbt" in names and commit.MARKER not in names
    assert all(object_store.is_ours(n) for n in names) and _siblings(gcs, dst) == [".fp8.inspect-lock"]
    code = cli.main(["orbax", "--path", dst])
    err = capsys.readouterr().err
    assert code == 2 and _one_line(err), err
    assert f"{dst}: incomplete: an inspect_checkpoint export is writing or publishing it" in err
    with pytest.raises(ValueError, match="incomplete checkpoint"):  # nor Orbax: its markers come at the commit
      _orbax_restore(f"{dst}/0/items")
    if point == "arrays":
      proc.send_signal(signal.SIGTERM)
    flag.unlink()
    _, err = proc.communicate(timeout=240)
  finally:
    proc.kill()
  if point == "arrays":
    assert proc.returncode == 128 + signal.SIGTERM and _one_line(err) and "interrupted by SIGTERM" in err
    assert gcs.listing(dst) == [] and _siblings(gcs, dst) == []
  else:
    assert proc.returncode == 0, err[-2000:]
    assert _is_new_export(gcs, dst) and _siblings(gcs, dst) == [] and cli.main(["orbax", "--path", dst]) == 0
    assert {"0/commit_success.txt", "0/items/commit_success.txt"} <= set(gcs.listing(dst))
  assert _local_leftovers(tmp_path) == []


@pytest.mark.parametrize("point", ["arrays", "publishing"])
def test_a_run_killed_writing_a_new_dst_leaves_it_incomplete_and_the_next_run_removes_it(gcs, tmp_path, capsys,
                                                                                          point):
  dst = _dst("fp8")
  killed = _export(dst, tmp_path, **{atomic.KILL_ENV: point})
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  left = gcs.listing(dst)
  assert left and commit.MARKER not in left and _siblings(gcs, dst) == [".fp8.inspect-lock"]
  assert cli.main(["orbax", "--path", dst]) == 2 and "incomplete" in capsys.readouterr().err
  again = _export(dst, tmp_path)  # without --overwrite: what the dead run left is not an export
  assert again.returncode == 0, again.stderr[-2000:]
  assert _is_new_export(gcs, dst) and _siblings(gcs, dst) == [] and _local_leftovers(tmp_path) == []
  assert not set(gcs.listing(dst)) & {n for n in left if "/d/" in n}  # the dead run's data files are gone


def test_a_second_export_to_a_locked_dst_is_refused_and_a_stop_cleans_up(gcs, tmp_path):
  dst, flag = _dst("fp8"), tmp_path / "paused"
  before = _previous(gcs, tmp_path, dst)
  first = _paused_export(dst, tmp_path, "staged", flag)
  try:
    _wait_for(flag, first)
    second = _export(dst, tmp_path, "--overwrite")
    assert second.returncode == 2 and _one_line(second.stderr)
    assert "is being written by another inspect_checkpoint run" in second.stderr
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
  finally:
    first.kill()
  assert first.returncode == 128 + signal.SIGTERM and _one_line(err) and "interrupted by SIGTERM" in err
  assert gcs.listing(dst) == before and _siblings(gcs, dst) == [] and _local_leftovers(tmp_path) == []


def test_a_lock_is_stale_when_its_process_is_gone_or_its_heartbeat_is_old():
  now = time.time()
  live = {"host": "elsewhere", "pid": 1, "heartbeat": now - remote_lock.STALE_S / 2}
  assert not remote_lock.stale(live, now)
  assert remote_lock.stale(dict(live, heartbeat=now - remote_lock.STALE_S - 1), now)
  proc = subprocess.Popen(["true"])  # a process of this host that has ended
  proc.wait()
  assert remote_lock.stale({"host": socket.gethostname(), "pid": proc.pid, "heartbeat": now}, now)
  assert not remote_lock.stale({"host": socket.gethostname(), "pid": os.getppid(), "heartbeat": now}, now)


def test_a_refused_bucket_is_one_line_and_nothing_is_written(gcs, capsys):
  denied = "denied-write-bucket"  # its own: test_gcs_read uploads into "denied-bucket" (one emulator per session)
  gcs.create_bucket(denied)
  with gcs.refusing(denied):  # the emulator's test-side proxy answers 403 for that bucket
    code = cli.main(["export", *TOKENS, "--checkpoint", CKPT, "--output", f"gs://{denied}/fp8", "--no-validate"])
  err = capsys.readouterr().err
  assert code == 2 and _one_line(err) and f"cannot write 'gs://{denied}/fp8': PERMISSION_DENIED" in err, err
  assert "http_response" not in err
  assert gcs.listing(f"gs://{denied}") == []


def test_an_upload_stored_with_other_bytes_fails_the_export_and_publishes_nothing(gcs, capsys):
  """Each streamed upload's MD5 is checked against the one the store computed: a store keeping other bytes than
  were sent (the emulator's proxy changes the last byte of gcsfs's uploads to this bucket) ends a deepseek-fp8
  export, whose shards are streamed so, with one line."""
  altered = "altered-write-bucket"
  gcs.create_bucket(altered)
  with gcs.altering(altered):
    code = cli.main(["export", *TOKENS, "--checkpoint", CKPT, "--output", f"gs://{altered}/fp8", "--no-validate",
                     "--layout", "deepseek-fp8"])
  err = capsys.readouterr().err
  assert code == 2 and _one_line(err), err
  assert f"cannot write 'gs://{altered}/fp8/" in err and "stored with other bytes than were sent (MD5 differs)" in err
  left = gcs.listing(f"gs://{altered}")  # uploads cancelled by the failure may still land in the staging prefix
  assert not [n for n in left if not n.startswith(".fp8.inspect-tmp-")], left
