"""`--topology` names → TPU devices to compile for, from any host (`jax.experimental.topologies`).

The names are MaxText 0.2.5's `compile_topology` names of TPU slices (v4, v5e, v5p, v6e, tpu7x), with the arguments
`get_topology_desc` takes for each (`tpu_topologies.txt`, made by scripts/make_tpu_topologies.py from MaxText's
table). A GPU name, a chip's name alone or a name libtpu does not know is refused in one line (exit 2).
"""

from __future__ import annotations

import dataclasses
import functools
import os

from inspect_tool import errors
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.xla_compile import libtpu

ACCEPTED = ("MaxText's TPU slice names (v4-8 to v4-4096, v5e-1 to v5e-256, v5p-8 to v5p-17920, v6e-1 to v6e-256, "
            "tpu7x-2 to tpu7x-18432; `inspect_checkpoint topologies` lists them)")
TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_topologies.txt")


@dataclasses.dataclass(frozen=True)
class Slice:
  """One TPU slice: MaxText's name and what `get_topology_desc` takes for it."""

  name: str
  topology: str  # v5:4x8x8
  chip_config: str  # megacore or default
  chips_per_host: tuple[int, ...]
  wrap: tuple[bool, ...]


@functools.lru_cache(maxsize=None)
def slices() -> dict[str, Slice]:
  """Every TPU slice name → its `Slice`, in MaxText's order."""
  out = {}
  with open(TABLE, encoding="utf-8") as f:
    for line in f:
      if line.startswith("#") or not line.strip():
        continue
      name, topology, chip_config, bounds, wrap = line.split()
      out[name] = Slice(name, topology, chip_config, tuple(int(b) for b in bounds.split(",")),
                        tuple(w == "1" for w in wrap.split(",")))
  return out


def slice_of(name: str) -> Slice:
  """The TPU slice `name`; `ConfigError` naming what is accepted for another name."""
  table = slices()
  if name not in table:
    if name in mesh_lib.topologies():
      why = "names a chip, not a slice" if mesh_lib.topology_devices(name) is None else "is not a TPU slice"
      raise errors.ConfigError(f"--compile needs a TPU slice: --topology {name} {why}; accepted: {ACCEPTED}")
    raise errors.ConfigError(f"{errors.UnknownKeyError(name, list(table), what='TPU topology')}; accepted: "
                             f"{ACCEPTED}")
  return table[name]


def devices(name: str, num_slices: int = 1) -> list:
  """The compile-only TPU devices of `num_slices` slices `name` (libtpu loaded here, never a TPU probed)."""
  chosen = slice_of(name)
  libtpu.require()
  libtpu.prepare(name)
  # lazy: JAX, ~0.6 s to import: the topology table and its errors load without it
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=chosen.topology,
                                        chip_config_name=chosen.chip_config, chips_per_host_bounds=chosen.chips_per_host,
                                        num_slices=num_slices, wrap=chosen.wrap)
  except Exception as e:  # pylint: disable=broad-except  (libtpu's own error types)
    raise errors.ConfigError(f"--topology {name}: libtpu {libtpu.installed()} cannot make this topology "
                             f"({chosen.topology}): {errors.first_line(e)}") from None
  return list(desc.devices)
