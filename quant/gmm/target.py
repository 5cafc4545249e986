"""The platform the grouped matmul is compiled for: JAX's default backend, unless a compilation target is set.

Compiling for a TPU topology from a host without one (`inspect_tool.xla_compile`) traces the model on a CPU host
for TPU devices: there `auto` must pick the Pallas kernel and the kernel must be compiled by Mosaic, not run in
Pallas interpret mode. `compiling_for("tpu")` says so for the code traced inside it; nothing else changes.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("gmm_compile_target", default=None)


def platform() -> str:
  """The compilation target set by `compiling_for`, else JAX's default backend (`cpu`, `gpu`, `tpu`)."""
  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(name: str):
  """Within the block, `platform()` is `name` (the platform of the devices a program is lowered for)."""
  token = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(token)
