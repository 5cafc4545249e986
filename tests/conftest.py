"""Suite-wide settings: JAX's persistent compilation cache (on by default for `forward` and `export`) lives in a
temporary directory of the test session, never in the user's ~/.cache; the tests that took longest when last measured
(`tests/durations.json`, `make durations`) are marked `heavy` (`make test-fast` leaves them out)."""

import json
import os
import pathlib

import pytest

from inspect_tool.run import compile_cache


DURATIONS = pathlib.Path(__file__).with_name("durations.json")
HEAVY_SECONDS = 1.5  # a test measured at this or more (setup included) is `heavy`


def pytest_collection_modifyitems(config, items):
  """Marks the heavy tests (a test not measured yet counts as quick)."""
  del config
  durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
  for item in items:
    if durations.get(item.nodeid, 0.0) >= HEAVY_SECONDS:
      item.add_marker(pytest.mark.heavy)


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache_in_a_temporary_directory(tmp_path_factory):
  saved = os.environ.get(compile_cache.JAX_ENV)
  os.environ[compile_cache.JAX_ENV] = str(tmp_path_factory.mktemp("jax-compilation-cache"))
  yield
  if saved is None:
    os.environ.pop(compile_cache.JAX_ENV, None)
  else:
    os.environ[compile_cache.JAX_ENV] = saved


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
