"""Per-parameter sharding and per-device memory on an abstract MaxText mesh (no devices needed).

`placement.plan(leaves, cfg, devices)` gives each leaf MaxText 0.2.5's `PartitionSpec` and shard shape;
`memory.device_memory(...)` sums the bytes one device holds. Modules: `mesh` (axis sizes from the ici_*/dcn_*
keys; `--topology` names, their chips and memory), `logical_axes` (MaxText's names per variable), `rules` (names →
mesh axes), `memory` (exact bytes and the verdict), `activations` (the training step's activation estimate),
`advice` (what would fit: more devices, bfloat16 weights).
"""

from __future__ import annotations

import dataclasses

from inspect_tool.sharding import advice
from inspect_tool.sharding import memory
from inspect_tool.sharding import mesh
from inspect_tool.sharding import placement


def devices_for(cfg, devices: int | None, topology: str | None) -> int | None:
  """The device count from `--devices` and/or `--topology` (× `num_slices`); they must agree when both given.
  A chip's name alone (`--topology h100`) sets only the memory: the count comes from `--devices`."""
  if topology is None:
    return devices
  per_slice = mesh.topology_devices(topology)
  if per_slice is None:
    if devices is None:
      raise mesh.ShardingError(f"--topology {topology} names a chip, not a slice: give the device count with "
                               "--devices N (or a slice name such as v5p-512)")
    return devices
  slices = mesh.num_slices(cfg)
  from_topology = per_slice * slices
  if devices is not None and devices != from_topology:
    times = f" × num_slices={slices} = {from_topology}" if slices > 1 else ""
    raise mesh.ShardingError(f"--devices {devices} disagrees with --topology {topology} ({per_slice} devices per "
                             f"slice{times}); give one of them, or both agreeing")
  return from_topology


def annotate(report, cfg, *, devices: int, train: str | None = None, device_memory: str | None = None,
             topology: str | None = None):
  """`report` with each leaf's spec and shard shape and the per-device memory table (`ParamReport` fields).

  The memory of one device is `--device-memory`, else the chip's of `--topology`; with an optimizer the verdict
  adds the activation estimate (`activations`), and a plan that does not fit gets `advice`."""
  limit, limit_source = None, None
  if device_memory is not None:
    limit, limit_source = memory.parse_bytes(device_memory), "--device-memory"
  elif topology is not None:
    chip = mesh.topology_chip(topology)
    limit, limit_source = chip.memory, f"{chip.name} ({chip.memory_text} per device, --topology {topology})"
  optimizer = memory.optimizer_of(cfg, train)
  plan = placement.plan(report.leaves, cfg, devices)
  mem = memory.device_memory(report.leaves, plan, cfg, optimizer=optimizer, limit=limit, limit_source=limit_source)
  if mem.fits is False:
    mem = dataclasses.replace(mem, advice=advice.advise(report.leaves, cfg, devices, mem))
  return dataclasses.replace(report, sharding=plan, memory=mem)
