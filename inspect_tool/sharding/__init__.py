"""Per-parameter sharding and per-device memory on an abstract MaxText mesh (no devices needed).

`placement.plan(leaves, cfg, devices)` gives each leaf MaxText 0.2.5's `PartitionSpec` and shard shape;
`memory.device_memory(...)` sums the bytes one device holds. Modules: `mesh` (axis sizes from the ici_*/dcn_*
keys), `logical_axes` (MaxText's names per variable), `rules` (names → mesh axes), `memory`.
"""

from __future__ import annotations

import dataclasses


def devices_for(cfg, devices: int | None, topology: str | None) -> int | None:
  """The device count from `--devices` and/or `--topology` (× `num_slices`); they must agree when both given."""
  from inspect_tool.sharding import mesh  # pylint: disable=import-outside-toplevel

  if topology is None:
    return devices
  per_slice, slices = mesh.topology_devices(topology), mesh.num_slices(cfg)
  from_topology = per_slice * slices
  if devices is not None and devices != from_topology:
    times = f" × num_slices={slices} = {from_topology}" if slices > 1 else ""
    raise mesh.ShardingError(f"--devices {devices} disagrees with --topology {topology} ({per_slice} devices per "
                             f"slice{times}); give one of them, or both agreeing")
  return from_topology


def annotate(report, cfg, *, devices: int, train: str | None = None, device_memory: str | None = None):
  """`report` with each leaf's spec and shard shape and the per-device memory table (`ParamReport` fields)."""
  from inspect_tool.sharding import memory, placement  # pylint: disable=import-outside-toplevel

  limit = memory.parse_bytes(device_memory) if device_memory is not None else None
  optimizer = memory.optimizer_of(cfg, train)
  plan = placement.plan(report.leaves, cfg, devices)
  mem = memory.device_memory(report.leaves, plan, cfg, optimizer=optimizer, limit=limit)
  return dataclasses.replace(report, sharding=plan, memory=mem)
