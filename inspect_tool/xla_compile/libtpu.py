"""libtpu, the TPU compiler: is it installed, at the version this JAX pins, and its environment for compiling.

The version JAX needs is the one its own `tpu` extra pins (`jax[tpu]` requires `libtpu==0.0.50.*` for jax 0.12.0.1,
`libtpu==0.0.42.*` for jax 0.10.2); `pip install -e '.[tpu]'` installs it. Without it, or at another version, a
command that compiles for a topology stops with one line saying what to install (exit 2).

Before libtpu is loaded, `prepare(topology)` sets what lets it start on a host without a TPU, each only when unset:
`ALLOW_MULTIPLE_LIBTPU_LOAD=1` (several processes may compile at once: libtpu otherwise holds one lock per host),
`TPU_SKIP_MDS_QUERY=1`, `TPU_ACCELERATOR_TYPE` (the topology's name) and `TPU_WORKER_HOSTNAMES=localhost` (libtpu
asks the cloud metadata server for these, and warns when it cannot reach it). None of them changes what XLA compiles.
"""

from __future__ import annotations

import importlib.metadata
import os
import re

from inspect_tool import errors
from inspect_tool.host import accelerator


class LibtpuMissing(errors.ConfigError):
  """libtpu is not installed, or not at the version this JAX pins (exit 2)."""


def pinned() -> str | None:
  """The libtpu requirement of the installed JAX's `tpu` extra (`0.0.50.*`), None when it names none."""
  for requirement in importlib.metadata.requires("jax") or ():
    found = re.match(r"\s*libtpu\s*==\s*([^;\s]+)\s*;.*extra\s*==\s*['\"]tpu['\"]", requirement)
    if found:
      return found.group(1)
  return None


def installed() -> str | None:
  """The installed libtpu's version, None when it is not installed."""
  if not accelerator.libtpu_installed():
    return None
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def matches(version: str, pin: str | None) -> bool:
  """Whether `version` satisfies `pin` (`0.0.50.*` or an exact version)."""
  if pin is None:
    return True
  if pin.endswith(".*"):
    return version == pin[:-2] or version.startswith(pin[:-1])
  return version == pin


def require() -> str:
  """The installed libtpu's version; `LibtpuMissing` (one line: what to install) when it is absent or not the
  version JAX pins."""
  jax_version = importlib.metadata.version("jax")
  pin = pinned()
  want = f"libtpu=={pin}" if pin else "libtpu"
  version = installed()
  how = f"install it with `pip install -e '.[tpu]'` (or `pip install --no-deps \"{want}\"`)"
  if version is None:
    raise LibtpuMissing(f"compiling for a TPU topology needs libtpu ({want}, jax {jax_version}'s pin), which is not "
                        f"installed; {how}")
  if not matches(version, pin):
    raise LibtpuMissing(f"libtpu {version} is installed but jax {jax_version} pins {want}; {how}")
  return version


def prepare(topology: str, environ=os.environ) -> None:
  """Sets libtpu's start-up environment for compiling `topology` on this host (each variable only when unset)."""
  environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if not accelerator.tpu_chips_present():
    environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    environ.setdefault("TPU_ACCELERATOR_TYPE", topology)
    environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
