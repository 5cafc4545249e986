"""Suite-wide settings: JAX's persistent compilation cache (on by default for `forward` and `export`) lives in a
temporary directory of the test session that its workers share, never in the user's ~/.cache; the tests that took longest when last measured
(`tests/durations.json`, `make durations`) are marked `heavy` (`make test-fast` leaves them out), and the files that
take longest start first, so that the two workers of `make test` end together."""

import collections
import json
import os
import pathlib

import pytest

from inspect_tool.run import compile_cache


DURATIONS = pathlib.Path(__file__).with_name("durations.json")
HEAVY_SECONDS = 1.5  # a test measured at this or more (setup included) is `heavy`


def pytest_collection_modifyitems(config, items):
  """Marks the heavy tests and orders the files by their measured time, longest first (each file's tests keep their
  order; a file or test not measured yet counts as quick)."""
  del config
  durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
  per_file = collections.Counter()
  for item in items:
    seconds = durations.get(item.nodeid, 0.0)
    per_file[item.nodeid.split("::")[0]] += seconds
    if seconds >= HEAVY_SECONDS:
      item.add_marker(pytest.mark.heavy)
  items.sort(key=lambda item: -per_file[item.nodeid.split("::")[0]])


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache_in_a_temporary_directory(tmp_path_factory):
  saved = os.environ.get(compile_cache.JAX_ENV)
  # One cache for the session's workers (pytest-xdist gives each its own basetemp, under one shared parent): the
  # programs one worker's exports compiled serve the other's. Entries are written whole, then renamed into place.
  root = tmp_path_factory.getbasetemp()
  shared = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "jax-compilation-cache"
  shared.mkdir(exist_ok=True)
  os.environ[compile_cache.JAX_ENV] = str(shared)
  yield
  if saved is None:
    os.environ.pop(compile_cache.JAX_ENV, None)
  else:
    os.environ[compile_cache.JAX_ENV] = saved


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """One local GCS emulator per test module (tests/gcs_emulator.py), its variables set in os.environ meanwhile.
  Per module, not per session: the emulator rewrites the metadata of every object it holds on each write, so a
  session's worth of objects made each upload of the later modules slower."""
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
