"""A multi-process export is as safe as one process: one plan per job, jobs that end, signals honoured.

Real processes on 127.0.0.1 (2 CPU devices each, the tiny checkpoint of tests/data), each given its own command
line as a cluster would: different budgets or keys, a bad input on one, a killed peer, a missing process, a stop
signal, an unreachable or malformed coordinator address.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref

import pytest

import memory_cgroup

from inspect_tool import errors
from inspect_tool.distributed import job, runtime
from inspect_tool.output import atomic
from inspect_tool.output import stop
from test_export_distributed import finish as _finish
from test_export_kill import _wait_for

pytestmark = pytest.mark.slow  # stress: multi-process jobs killed, stopped, timed out (.ci/run: once)

from conftest import REPO
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
TOKENS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
          "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(**extra):
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", **extra)


def _export(dst, *extra):
  return [sys.executable, "-m", "inspect_tool", "export", *TOKENS, "--checkpoint", CKPT, "--output", str(dst),
          "--no-validate", "--quiet", *extra]


def _start(dst, extras, envs=None, n=2, timeout=60):
  """Starts `len(extras)` processes of an `n`-process export job, process i with `extras[i]` and `envs[i]`."""
  port = _free_port()
  envs = envs or [{}] * len(extras)
  return [subprocess.Popen(_export(dst, *extra, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                                   "--process-id", str(i), "--timeout", str(timeout)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(**env))
          for i, (extra, env) in enumerate(zip(extras, envs))]


def _one_line(err: str) -> str:
  lines = err.strip().splitlines()
  assert len(lines) == 1, err[-3000:]
  return lines[0]


def _small_budget(tmp_path) -> str:
  """A budget 40 MiB above the smallest one this machine accepts (named by the refusal of 1 KB): what the process
  holds at start differs between machines, so a fixed figure is refused on some."""
  out = subprocess.run(_export(tmp_path / "refused", "--max-memory", "1KB"), capture_output=True, text=True,
                       cwd=REPO, env=_env(), check=False, timeout=240)
  return f"{(memory_cgroup.accepted_floor(out) + 40 * 2**20) // 10**6}MB"


def test_processes_with_different_budgets_run_the_smallest_budgets_plan(tmp_path):
  """Process 0 with 4GB, process 1 with a small budget: once a checkpoint with chunks missing and exit 0 on both;
  now the job runs the small budget's plan everywhere and writes the arrays one process writes with it, byte for
  byte."""
  from test_export_distributed import _arrays  # pylint: disable=import-outside-toplevel

  small = _small_budget(tmp_path)
  single = subprocess.run(_export(tmp_path / "one", "--max-memory", small), capture_output=True, text=True,
                          cwd=REPO, env=_env(), check=False, timeout=240)
  assert single.returncode == 0, single.stderr[-2000:]
  outs = _finish(_start(tmp_path / "two", [["--max-memory", "4GB"], ["--max-memory", small]]))
  assert [code for code, _, _ in outs] == [0, 0], outs[0][2][-2000:] + outs[1][2][-2000:]
  report = json.loads((tmp_path / "two" / "quantization_report.json").read_text())
  assert report["memory"]["max_memory"] == int(small[:-2]) * 10**6 and report["memory"]["processes"] == 2
  a, b = _arrays(str(tmp_path / "one")), _arrays(str(tmp_path / "two"))
  assert sorted(a) == sorted(b) and len(a) == 73
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


def test_processes_with_different_keys_fail_on_every_process_and_write_nothing(tmp_path):
  """quantize_mtp=true on process 1 only (other arrays): once 58 of 73 arrays and exit 0; now one line each."""
  outs = _finish(_start(tmp_path / "dst", [[], ["quantize_mtp=true"]]))
  lines = [_one_line(err) for _, _, err in outs]
  assert [code for code, _, _ in outs] == [2, 2] and lines[0] == lines[1]
  assert "different keys" in lines[0] and "quantize_mtp=true" in lines[0]
  assert os.listdir(tmp_path) == []


def test_a_bad_budget_after_joining_ends_every_process_with_the_same_line(tmp_path):
  outs = _finish(_start(tmp_path / "dst", [[], ["--max-memory", "1KB"]]))
  lines = [_one_line(err) for _, _, err in outs]
  assert [code for code, _, _ in outs] == [2, 2] and lines[0] == lines[1]
  assert "--max-memory 1000 B is smaller" in lines[0]
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad, says", [(["quantize_mpt=true"], "quantize_mpt"),
                                       (["--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt")])
def test_a_bad_input_on_one_process_is_refused_before_joining(tmp_path, bad, says):
  """Once the peers waited forever; now the bad process ends at once and tells process 0, which ends with its line
  (not after --timeout: a generous 60 s here, and the whole job must end well before it)."""
  start = time.monotonic()
  outs = _finish(_start(tmp_path / "dst", [[], bad], timeout=60))
  assert time.monotonic() - start < 50
  assert outs[1][0] == 2 and says in _one_line(outs[1][2])
  assert outs[0][0] == 2 and _one_line(outs[0][2]).startswith("error: process 1: ") and says in outs[0][2]
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_process_ends_the_other_with_one_line(tmp_path, killed):
  envs = [{}, {}]
  envs[killed] = {atomic.KILL_ENV: "arrays"}
  procs = _start(tmp_path / "dst", [[], []], envs)
  outs = _finish(procs)
  assert outs[killed][0] == -signal.SIGKILL
  code, _, err = outs[1 - killed]
  assert code == 2 and f"process {killed} ended" in _one_line(err)
  assert not (tmp_path / "dst").exists()
  if killed == 1:  # process 0 removed its temporary directory; only its lock file stays until the next run
    assert os.listdir(tmp_path) in ([], [".dst.lock"])


def test_a_stopped_process_ends_the_job_within_the_timeout(tmp_path):
  """Process 1 frozen (SIGSTOP, no heartbeats): process 0 ends with one line after --timeout, then process 1, let
  go, ends with one line too; nothing is written."""
  flag = tmp_path / "paused"
  procs = _start(tmp_path / "out" / "dst", [[], []], [{}, {atomic.PAUSE_ENV: f"start:{flag}"}], timeout=5)
  (tmp_path / "out").mkdir()
  try:
    _wait_for(flag, procs[1])
    procs[1].send_signal(signal.SIGSTOP)
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode == 2 and "process 1 sent nothing for 5 s" in _one_line(err)
    procs[1].send_signal(signal.SIGCONT)
    flag.unlink()
  finally:
    outs = _finish(procs[1:])
  assert outs[0][0] == 2 and "process 0: process 1 sent nothing for 5 s" in _one_line(outs[0][2])
  assert [n for n in os.listdir(tmp_path / "out") if n != ".dst.lock"] == []


def test_a_missing_process_ends_the_job_within_the_timeout(tmp_path):
  """3 processes declared, 2 started: both end with one line after --timeout (5 s), not a SIGABRT after 126 s."""
  started = time.monotonic()
  outs = _finish(_start(tmp_path / "dst", [[], []], n=3, timeout=5))
  assert time.monotonic() - started < 60
  assert [code for code, _, _ in outs] == [2, 2]
  assert "process(es) 2 of --num-processes 3 did not join within 5 s" in _one_line(outs[0][2])
  assert "process 0: process(es) 2 of --num-processes 3 did not join within 5 s" in _one_line(outs[1][2])
  assert os.listdir(tmp_path) == []


def test_a_closed_coordinator_port_is_one_line_within_the_timeout(tmp_path):
  proc = subprocess.run(_export(tmp_path / "dst", "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes",
                                "2", "--process-id", "1", "--timeout", "2"),
                        capture_output=True, text=True, cwd=REPO, env=_env(), check=False, timeout=120)
  assert proc.returncode == 2 and "nobody listens at the coordinator" in _one_line(proc.stderr)


def test_a_process_started_without_process_0_gives_up_in_one_line_without_a_timeout(tmp_path):
  """No --timeout (300 s by default): a port that refuses (nobody listens) ends the wait after REFUSED_S."""
  start = time.monotonic()
  proc = subprocess.run(_export(tmp_path / "dst", "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes",
                                "2", "--process-id", "1"),
                        capture_output=True, text=True, cwd=REPO, env=_env(), check=False, timeout=120)
  took = time.monotonic() - start
  line = _one_line(proc.stderr)
  assert proc.returncode == 2 and "nobody listens at the coordinator 127.0.0.1:" in line and "--timeout" in line
  assert job.REFUSED_S <= took < job.REFUSED_S + 30, took
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("address, says", [
    ("nohost.invalid:1234", "does not resolve"), (":", "is not HOST:PORT"), ("127.0.0.1:99999", "is not HOST:PORT"),
    ("http://127.0.0.1:1234", "no scheme"), ("127.0.0.1:0", "is not HOST:PORT"), ("10.0.0.1", "is not HOST:PORT"),
    ("[::1]:", "is not HOST:PORT")])
def test_coordinator_addresses_are_checked_before_use(address, says):
  with pytest.raises(errors.InputError, match=says):
    runtime.check_flags(address, 2, 0)


def test_accepted_coordinator_addresses():
  assert runtime.parse_coordinator("127.0.0.1:1234") == ("127.0.0.1", 1234)
  assert runtime.parse_coordinator("[::1]:65535") == ("::1", 65535)
  assert runtime.parse_coordinator("localhost:1") == ("localhost", 1)


def test_bad_address_and_deepseek_layout_are_refused_before_joining(tmp_path):
  bad = subprocess.run(_export(tmp_path / "dst", "--coordinator", "http://host:80", "--num-processes", "2",
                               "--process-id", "0"), capture_output=True, text=True, cwd=REPO, env=_env(),
                       check=False, timeout=120)
  assert bad.returncode == 2 and "--coordinator 'http://host:80'" in _one_line(bad.stderr)
  layout = subprocess.run(_export(tmp_path / "dst", "--layout", "deepseek-fp8", "--coordinator", "127.0.0.1:1234",
                                  "--num-processes", "2", "--process-id", "1"), capture_output=True, text=True,
                          cwd=REPO, env=_env(), check=False, timeout=120)
  assert layout.returncode == 2 and "is written by one process" in _one_line(layout.stderr)
  assert os.listdir(tmp_path) == []


def _previous(dst):
  (dst / "0").mkdir(parents=True)
  (dst / "quantization_report.json").write_text(json.dumps({"producer": {"name": "inspect_checkpoint"}}))
  return sorted(os.listdir(dst))


def test_sigterm_to_process_0_of_a_job_commits_nothing_and_ends_both(tmp_path):
  """Once swallowed by JAX's preemption notifier (the export completed and replaced DST given --overwrite)."""
  out = tmp_path / "out"
  out.mkdir()
  before = _previous(out / "dst")
  flag = tmp_path / "paused"
  procs = _start(out / "dst", [["--overwrite"], ["--overwrite"]], [{atomic.PAUSE_ENV: f"written:{flag}"}, {}])
  try:
    _wait_for(flag, procs[0])
    procs[0].send_signal(signal.SIGTERM)
  finally:
    outs = _finish(procs)
  assert outs[0][0] == 128 + signal.SIGTERM and "interrupted by SIGTERM" in _one_line(outs[0][2])
  assert outs[1][0] == 2 and "process 0: interrupted by SIGTERM" in _one_line(outs[1][2])
  assert sorted(os.listdir(out / "dst")) == before
  assert "command" not in (out / "dst" / "quantization_report.json").read_text()
  assert [n for n in os.listdir(out) if n != ".dst.lock"] == ["dst"]


_AFTER_JAX_INIT = """
import os, signal, sys, time
from inspect_tool.distributed import runtime
from inspect_tool.output import stop
from inspect_tool import errors
stop.install_handlers()
runtime.initialize(sys.argv[1], 2, int(sys.argv[2]), timeout=60, jax_runtime=True)
try:
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(5)
  print("not stopped")
except errors.Interrupted as e:
  print("stopped by", e)
runtime.barrier("end")
"""


def test_stop_handlers_survive_jax_distributed_initialize():
  address = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", _AFTER_JAX_INIT, address, str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(PYTHONPATH=REPO)) for i in (0, 1)]
  outs = _finish(procs, timeout=120)
  assert [out for _, out, _ in outs] == ["stopped by SIGTERM\n"] * 2, outs[0][2][-2000:]


@pytest.fixture
def stop_handlers():
  previous = {name: signal.getsignal(getattr(signal, name)) for name in stop.NAMES}
  previous_hook = sys.unraisablehook
  stop.clear()
  stop.install_handlers()
  yield
  stop.clear()
  for name, handler in previous.items():
    signal.signal(getattr(signal, name), handler)
  sys.unraisablehook = previous_hook


def _raises_interrupted_soon(trigger) -> None:
  """`trigger()` sends SIGINT from a place where Python drops exceptions; the stop must still arrive, within 2 s."""
  with pytest.raises(errors.Interrupted) as caught:
    trigger()
    for _ in range(200):
      time.sleep(0.01)
  assert caught.value.signum == signal.SIGINT


@pytest.mark.usefixtures("stop_handlers")
def test_ctrl_c_landing_in_a_gc_callback_is_not_dropped(capfd):
  """Python drops an exception raised in a gc callback ("Exception ignored in"); the stop arrives just after it."""
  fired = []

  def callback(phase, info):  # pylint: disable=unused-argument
    if phase == "start" and not fired:
      fired.append(True)
      os.kill(os.getpid(), signal.SIGINT)

  gc.callbacks.append(callback)
  try:
    _raises_interrupted_soon(gc.collect)
  finally:
    gc.callbacks.remove(callback)
  assert fired and "Exception ignored" not in capfd.readouterr().err


@pytest.mark.usefixtures("stop_handlers")
def test_ctrl_c_landing_in_a_weakref_callback_run_by_the_collector_is_not_dropped(capfd):
  """Collecting a cycle runs the weakref callbacks of its objects (any library's cleanup); Python drops what they
  raise as it does in gc callbacks."""
  fired = []

  class Node:
    pass

  def on_collect(ref):  # pylint: disable=unused-argument
    fired.append(True)
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(1000))  # a few calls: the handler runs here, inside the callback

  node = Node()
  node.cycle = node
  ref = weakref.ref(node, on_collect)
  del node
  _raises_interrupted_soon(gc.collect)
  assert fired and ref() is None and "Exception ignored" not in capfd.readouterr().err


@pytest.mark.usefixtures("stop_handlers")
def test_a_stop_swallowed_by_the_work_never_commits(tmp_path):
  dst = tmp_path / "dst"
  with pytest.raises(errors.Interrupted):
    with atomic.atomic_directory(str(dst)) as tmp:
      (tmp_path / "dst.written").write_text(tmp)
      try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
      except errors.Interrupted:
        pass  # code that swallows it
  assert os.listdir(tmp_path) == ["dst.written"]


# Signals we do not handle (SIGQUIT is a stop signal now, tested in test_export_kill): the default action kills.
@pytest.mark.parametrize("signum", [signal.SIGUSR2, signal.SIGUSR1])
def test_an_unhandled_signal_leaves_only_what_the_next_run_cleans(tmp_path, signum):
  out = tmp_path / "out"
  out.mkdir()
  flag = tmp_path / "paused"
  proc = subprocess.Popen(_export(out / "dst"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                          env=_env(**{atomic.PAUSE_ENV: f"arrays:{flag}"}))
  try:
    _wait_for(flag, proc)
    proc.send_signal(signum)
    proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == -signum
  assert any(n.startswith(".dst.tmp-") for n in os.listdir(out))  # it died mid-write
  again = subprocess.run(_export(out / "dst"), capture_output=True, text=True, cwd=REPO, env=_env(), check=False,
                         timeout=240)
  assert again.returncode == 0, again.stderr[-2000:]
  assert os.listdir(out) == ["dst"]


POINTS = ("start", "arrays", "written", "report", "swap")


# Repeated signals: the first attempt runs on every stack, the other 19 once, on the primary stack (marked slow).
@pytest.mark.parametrize("attempt", range(20))
def test_sigterm_during_an_overwrite_export_ends_it_promptly(tmp_path, attempt):
  """The intermittent hang: a SIGTERM whose exception landed in JAX's gc callback was dropped and the export ran on
  (validation included) for tens of seconds. 20 attempts at the stages' pause points, each must end within 30 s
  with one line and the previous DST intact."""
  out = tmp_path / "out"
  out.mkdir()
  before = _previous(out / "dst")
  flag = tmp_path / "paused"
  point = POINTS[attempt % len(POINTS)]
  proc = subprocess.Popen(_export(out / "dst", "--overwrite"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=REPO, env=_env(**{atomic.PAUSE_ENV: f"{point}:{flag}"}))
  try:
    _wait_for(flag, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM and "interrupted by SIGTERM" in _one_line(err)
  assert sorted(os.listdir(out / "dst")) == before and os.listdir(out) == ["dst"]


def _two_writers(tmp_path, rows_by_process):
  """Process 0 and 1's writers of one (4, 3) array in 4 one-row chunks, each writing `rows_by_process[i]`."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import orbax_writer  # pylint: disable=import-outside-toplevel

  items = tmp_path / "0" / "items"
  items.mkdir(parents=True)
  key, value = ("params", "params", "w"), np.arange(12, dtype=np.float32).reshape(4, 3)
  writers = [orbax_writer.OrbaxArrayWriter(str(items), process_index=i) for i in range(2)]
  for i, writer in enumerate(writers):
    writer.register(key, (1, 3), value.shape, value.dtype)
    if rows_by_process[i] is None:
      continue
    store, = writer.create_many([(key, value.shape, value.dtype, (1, 3))])
    for row in rows_by_process[i]:
      writer.write(store, (slice(row, row + 1),), value[row:row + 1])
    writer.wait()
  return writers[0], str(tmp_path / "0")


def test_the_merge_refuses_a_missing_chunk_or_database(tmp_path):
  """The merge (process 0) checks every process's database and every chunk before anything is committed."""
  from inspect_tool.errors import CheckpointError  # pylint: disable=import-outside-toplevel

  writer, step = _two_writers(tmp_path / "a", [[0, 2], [1]])  # row 3 (chunk c/3/0) written by no one
  with pytest.raises(CheckpointError, match="array params/params/w of the merged checkpoint has 3 of its 4 chunks"):
    writer.finalize(step, "items", 2)
  writer, step = _two_writers(tmp_path / "b", [[0, 2], None])  # process 1 wrote nothing
  with pytest.raises(CheckpointError, match=r"the databases of process\(es\) 1 are missing"):
    writer.finalize(step, "items", 2)
  writer, step = _two_writers(tmp_path / "c", [[0, 2], [1, 3]])
  writer.finalize(step, "items", 2)
  assert os.path.exists(os.path.join(step, "items", "_METADATA"))


def test_a_job_exchanges_over_ipv4_and_ipv6_and_relays_a_failure_to_all():
  """`distributed.job.Job` in threads: every process gets every text; a failure on process 2 reaches 0 and 1."""
  from inspect_tool.distributed import job  # pylint: disable=import-outside-toplevel

  port, got = _free_port(), {}

  def run(index, host):
    member = job.Job(host, port, 3, index, 10)
    try:
      got[index] = [member.exchange("first", str(index))]
      if index == 2:
        member.fail("boom")
        return
      member.exchange("second", "")
    except job.JobError as e:
      got[index].append(str(e))
    finally:
      member.close()

  import threading  # pylint: disable=import-outside-toplevel
  six = "::1" if socket.has_dualstack_ipv6() else "127.0.0.1"  # IPv6 where this host has it
  threads = [threading.Thread(target=run, args=args) for args in ((0, ""), (1, six), (2, "127.0.0.1"))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(60)
  assert got == {0: [["0", "1", "2"], "process 2: boom"], 1: [["0", "1", "2"], "process 2: boom"],
                 2: [["0", "1", "2"]]}
