"""The platform the grouped matmul is compiled for: JAX's default backend, unless a compilation target is set.

Compiling for a TPU topology from a host without one (`inspect_tool.xla_compile`) traces the model on a CPU host
for TPU devices: there `auto` must pick the Pallas kernel and the kernel must be compiled by Mosaic, not run in
Pallas interpret mode. `compiling_for("tpu", kind)` says so for the code traced inside it, and which chip (its
`device_kind`, for the VMEM the kernel may use: `vmem_bytes`); nothing else changes.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar("gmm_compile_target",
                                                                                      default=None)
# VMEM of one TensorCore by device kind (first match; "TPU v5 lite" before "TPU v5"): what Mosaic may fill. v4's is
# XLA's own figure ("Used 22.51M of 16.00M vmem"); v5e's and v6e's 128 MiB, v5p's 95 MiB are Google's.
VMEM_BY_KIND = (("TPU v4", 16 * 2**20), ("TPU v5 lite", 128 * 2**20), ("TPU v6 lite", 128 * 2**20),
                ("TPU v5", 95 * 2**20), ("TPU7x", 64 * 2**20))
DEFAULT_VMEM = 16 * 2**20  # a chip not in the table: the smallest


def platform() -> str:
  """The compilation target set by `compiling_for`, else JAX's default backend (`cpu`, `gpu`, `tpu`)."""
  target = _TARGET.get()
  return target[0] if target else jax.default_backend()


def device_kind() -> str:
  """The target chip's `device_kind` (set by `compiling_for`), else the first device's."""
  target = _TARGET.get()
  if target and target[1]:
    return target[1]
  return jax.devices()[0].device_kind


def vmem_bytes() -> int:
  """The VMEM a Pallas kernel may use on the target chip (`VMEM_BY_KIND`)."""
  kind = device_kind()
  return next((size for name, size in VMEM_BY_KIND if kind.startswith(name)), DEFAULT_VMEM)


@contextlib.contextmanager
def compiling_for(name: str, kind: str | None = None):
  """Within the block, `platform()` is `name` (the platform of the devices a program is lowered for) and
  `device_kind()` is `kind` when given."""
  token = _TARGET.set((name, kind))
  try:
    yield
  finally:
    _TARGET.reset(token)
