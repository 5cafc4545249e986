"""Suite-wide settings: one JAX persistent compilation cache for the whole run (the test processes and every command
they start), in a temporary directory, never the user's ~/.cache; the tests that took longest when last measured
(`tests/durations.json`, `make durations`) are marked `heavy` (`make test-fast` leaves them out), and the files run
longest first, those that mostly wait spread among the others (`_file_order`). Shared by the tests: `REPO`, `DATA` and `run_cli` (`from conftest import ...`)."""

import json
import os
import pathlib
import shutil
import tempfile

import pytest

from inspect_tool.run import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout the suite runs in
DATA = os.path.join(REPO, "tests", "data")  # every test's data, copied from ../shared/reference (tests/README.md)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
  """The in-process command `inspect_checkpoint ARGV...` (each argument as a string): exit code, stdout, stderr."""
  from inspect_tool import cli  # pylint: disable=import-outside-toplevel

  code = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


DURATIONS = pathlib.Path(__file__).with_name("durations.json")
HEAVY_SECONDS = 1.0  # a test measured at this or more (setup included) is `heavy`
UNMEASURED_SECONDS = 0.1  # a test under the measured threshold (scripts/test_durations.py), for ordering
_SAVED_CACHE_ENV = pytest.StashKey[str | None]()


def _on_tpu() -> bool:
  """Whether JAX runs on a TPU chip here (a TPU host whose JAX_PLATFORMS does not keep JAX off it)."""
  from inspect_tool.host import accelerator  # pylint: disable=import-outside-toplevel

  platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms and "tpu" not in platforms.split(","):
    return False
  return accelerator.tpu_chips_present()


def pytest_collection_modifyitems(config, items):
  """Marks the heavy tests (a test not measured yet counts as quick), skips the `tpu` tests off a TPU host, and
  orders the files for `-n 2 --dist loadfile` (`_file_order`)."""
  if not _on_tpu():
    no_chip = pytest.mark.skip(reason="needs a TPU chip (none here): `make test-tpu` runs it on a TPU host")
    for item in items:
      if "tpu" in item.keywords:
        item.add_marker(no_chip)
  durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
  for item in items:
    if durations.get(item.nodeid, 0.0) >= HEAVY_SECONDS:
      item.add_marker(pytest.mark.heavy)
  by_file: dict[str, list] = {}
  for item in items:
    by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
  items[:] = [item for name in _file_order(by_file, durations) for item in by_file[name]]
  if hasattr(config.option, "loadscopereorder"):  # xdist: keep this order (its own sorts files by test count)
    config.option.loadscopereorder = False


def _file_order(by_file: dict, durations: dict) -> list[str]:
  """Longest files first (so that the two workers end together), with the files that mostly wait (commands in
  memory cgroups: the disk; the GCS emulator) spread among the others, so that while one worker waits the other
  computes: each waiting file is placed once at least as many seconds of computing files have been queued since the
  previous one."""
  seconds = {name: sum(durations.get(item.nodeid, UNMEASURED_SECONDS) for item in tests)
             for name, tests in by_file.items()}
  waiting = sorted((n for n, tests in by_file.items() if _waits(tests)), key=lambda n: -seconds[n])
  computing = sorted((n for n in by_file if n not in waiting), key=lambda n: -seconds[n])
  order, queued = [], float("inf")
  while waiting or computing:
    if waiting and (queued >= seconds[waiting[0]] or not computing):
      order.append(waiting.pop(0))
      queued = 0.0
    else:
      order.append(computing.pop(0))
      queued += seconds[order[-1]]
  return order


def _waits(tests) -> bool:
  """Whether a file's tests mostly wait: they run commands in memory cgroups (`memory_cgroup`, or a `CGROUP_ROOT` of
  their own), which wait on the disk, or talk to the `gcs` emulator."""
  module = tests[0].module
  cgroups = hasattr(module, "memory_cgroup") or hasattr(module, "CGROUP_ROOT")
  return cgroups or any("gcs" in item.fixturenames for item in tests)


def pytest_configure(config):
  """On a TPU host the tests' own JAX rounds as the value commands do there (`accelerator.round_like_a_cpu`).
  One compilation cache for the whole run, never the user's ~/.cache: a temporary directory made by the main
  process (`make test`'s xdist controller, or the only process) and inherited by the workers and by every command the
  tests start; the test processes use it too, so a program compiled anywhere in the run is compiled once."""
  from inspect_tool.host import accelerator  # pylint: disable=import-outside-toplevel
  accelerator.round_like_a_cpu(["forward"])
  if not hasattr(config, "workerinput"):  # the main process: a directory of its own for the run
    config.stash[_SAVED_CACHE_ENV] = os.environ.get(compile_cache.JAX_ENV)
    os.environ[compile_cache.JAX_ENV] = tempfile.mkdtemp(prefix="inspect-checkpoint-tests-jax-cache-")
  compile_cache.configure()


def pytest_unconfigure(config):
  if _SAVED_CACHE_ENV in config.stash:
    shutil.rmtree(os.environ.pop(compile_cache.JAX_ENV), ignore_errors=True)
    if config.stash[_SAVED_CACHE_ENV] is not None:
      os.environ[compile_cache.JAX_ENV] = config.stash[_SAVED_CACHE_ENV]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """One local GCS emulator per test module (tests/gcs_emulator.py: fake-gcs-server, or gcp-storage-emulator with
  INSPECT_GCS_EMULATOR), its variables set in os.environ meanwhile. Per module, not per session: gcp-storage-emulator
  rewrites the metadata of every object it holds on each write, so a session's worth of objects made each upload of
  the later modules slower."""
  from gcs_emulator import emulator  # pylint: disable=import-outside-toplevel

  with emulator(tmp_path_factory.mktemp("gcs-emulator")) as running:
    saved = {name: os.environ.get(name) for name in running.env}
    os.environ.update(running.env)
    try:
      yield running
    finally:
      for name, value in saved.items():
        if value is None:
          os.environ.pop(name, None)
        else:
          os.environ[name] = value
