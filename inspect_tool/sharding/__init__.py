"""Per-parameter sharding and per-device memory on an abstract MaxText mesh (no devices needed).

`placement.plan(leaves, cfg, devices)` gives each leaf MaxText 0.2.5's `PartitionSpec` and shard shape;
`memory.device_memory(...)` sums the bytes one device holds. Modules: `mesh` (axis sizes from the ici_*/dcn_*
keys; `--topology` names, their chips and memory), `logical_axes` (MaxText's names per variable), `rules` (names →
mesh axes), `memory` (exact bytes and the verdict), `activations` (the training step's activation estimate),
`advice` (what would fit: the batch, more devices, bfloat16 weights), `invocation` (a plan's command line, changed
and planned again).
"""

from __future__ import annotations

import dataclasses

from inspect_tool.sharding import advice
from inspect_tool.sharding import invocation
from inspect_tool.sharding import memory
from inspect_tool.sharding import mesh
from inspect_tool.sharding import placement
from inspect_tool.sharding import xla_grid

devices_for = invocation.devices_for


def annotate(report, cfg, *, devices: int, train: str | None = None, device_memory: str | None = None,
             topology: str | None = None, overrides=None):
  """`report` with each leaf's spec and shard shape and the per-device memory table (`ParamReport` fields).

  The memory of one device is `--device-memory`, else the chip's of `--topology`; with an optimizer the verdict
  adds the activation estimate (`activations`), and a plan that does not fit gets `advice`: with the `overrides`
  that made `cfg`, each way to fit as the `maxtext` command line that plans it."""
  limit, limit_source = invocation.limit_of(device_memory, topology)
  optimizer = memory.optimizer_of(cfg, train)
  plan = placement.plan(report.leaves, cfg, devices)
  mem = memory.device_memory(report.leaves, plan, cfg, optimizer=optimizer, limit=limit, limit_source=limit_source,
                             tpu=invocation.on_tpu(topology))
  if optimizer is not None and overrides is not None:
    keys = [k for k in overrides if not k.startswith("opt_type=")] + [f"opt_type={optimizer}"]
    mem = dataclasses.replace(mem, grid_point=xla_grid.nearest(keys, topology))
  if mem.fits is False:
    call = None
    if overrides is not None:
      given = None if topology is not None and mesh.topology_devices(topology) is not None else devices
      call = invocation.Invocation(tuple(overrides), given, topology, train, device_memory)
    mem = dataclasses.replace(mem, advice=advice.advise(report.leaves, cfg, devices, mem, call))
  return dataclasses.replace(report, sharding=plan, memory=mem)
