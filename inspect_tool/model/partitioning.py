"""The device mesh a model is traced for, and MaxText's activation shardings on it (no-ops without one).

A model traced for many devices (`inspect_tool.xla_compile`) runs inside `partitioned(Partitioning(...))`: the
mesh and `spec`, which turns MaxText's logical activation names (`activation_batch`, `activation_embed`, ...) into
a `PartitionSpec` under the config's `logical_axis_rules`. The layers then pin their activations where MaxText
does (`constrain`), and the routed experts and attention run per device (`shard_map`) as MaxText's do. Outside
such a block (every other command) nothing here changes the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

Names = Sequence[str | None]


@dataclasses.dataclass(frozen=True)
class Partitioning:
  """The mesh, logical names → `PartitionSpec`, and the platform the program is compiled for."""

  mesh: jax.sharding.Mesh
  spec: Callable[[tuple[str | None, ...]], PartitionSpec]
  platform: str = "tpu"

  def of(self, names: Names) -> PartitionSpec:
    return self.spec(tuple(names))

  def axis_size(self, names: Names) -> int:
    """The number of devices the mesh axes of `names`' single logical name shard over."""
    size = 1
    for entry in self.of(names):
      for axis in (entry,) if isinstance(entry, str) else entry or ():
        size *= self.mesh.shape[axis]
    return size


_ACTIVE: contextvars.ContextVar[Partitioning | None] = contextvars.ContextVar("partitioning", default=None)


def active() -> Partitioning | None:
  """The partitioning the model is being traced for, None outside `partitioned`."""
  return _ACTIVE.get()


@contextlib.contextmanager
def partitioned(partitioning: Partitioning):
  """Within the block, layers shard their activations for `partitioning`."""
  token = _ACTIVE.set(partitioning)
  try:
    yield partitioning
  finally:
    _ACTIVE.reset(token)


def constrain(x, names: Names):
  """`x` pinned to MaxText's sharding for the logical `names` (one per dimension); `x` itself when unpartitioned."""
  part = active()
  if part is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(part.mesh, part.of(names)))
