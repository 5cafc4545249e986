"""Suite-wide settings: JAX's persistent compilation cache (on by default for `forward` and `export`) lives in a
temporary directory of the test session, never in the user's ~/.cache."""

import os

import pytest

from inspect_tool.run import compile_cache


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache_in_a_temporary_directory(tmp_path_factory):
  saved = os.environ.get(compile_cache.JAX_ENV)
  os.environ[compile_cache.JAX_ENV] = str(tmp_path_factory.mktemp("jax-compilation-cache"))
  yield
  if saved is None:
    os.environ.pop(compile_cache.JAX_ENV, None)
  else:
    os.environ[compile_cache.JAX_ENV] = saved
