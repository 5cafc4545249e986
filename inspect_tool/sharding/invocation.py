"""A `maxtext` plan's inputs as the command line that makes it: keys and the device count changed, the line
printed, and its plan made again, so that advice only prints lines whose plan fits.

`devices_for` and `limit_of` turn `--devices` / `--topology` / `--device-memory` into a device count and the memory
of one device, for `annotate` and for each line the advice prints alike.
"""

from __future__ import annotations

import dataclasses
import shlex

from inspect_tool.configuration import config as config_lib
from inspect_tool.sharding import memory as memory_lib
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import placement
from inspect_tool.sharding import topology_table


def devices_for(cfg, devices: int | None, topology: str | None) -> int | None:
  """The device count from `--devices` and/or `--topology` (× `num_slices`); they must agree when both given.
  A chip's name alone (`--topology h100`) sets only the memory: the count comes from `--devices`."""
  if topology is None:
    return devices
  per_slice = mesh_lib.topology_devices(topology)
  if per_slice is None:
    if devices is None:
      raise mesh_lib.ShardingError(f"--topology {topology} names a chip, not a slice: give the device count with "
                                   "--devices N (or a slice name such as v5p-512)")
    return devices
  slices = mesh_lib.num_slices(cfg)
  from_topology = per_slice * slices
  if devices is not None and devices != from_topology:
    times = f" × num_slices={slices} = {from_topology}" if slices > 1 else ""
    raise mesh_lib.ShardingError(f"--devices {devices} disagrees with --topology {topology} ({per_slice} devices per "
                                 f"slice{times}); give one of them, or both agreeing")
  return from_topology


def on_tpu(topology: str | None) -> bool:
  """Whether arrays are sized in TPU tiles: a TPU `--topology`, or none given (MaxText's own target)."""
  return topology is None or mesh_lib.topology_chip(topology).name not in topology_table.GPU_CHIPS


def limit_of(device_memory: str | None, topology: str | None) -> tuple[int | None, str | None]:
  """The memory of one device and where it came from: `--device-memory`, else the `--topology` chip's."""
  if device_memory is not None:
    return memory_lib.parse_bytes(device_memory), "--device-memory"
  if topology is not None:
    chip = mesh_lib.topology_chip(topology)
    return chip.memory, f"{chip.name} ({chip.memory_text} per device, --topology {topology})"
  return None, None


@dataclasses.dataclass(frozen=True)
class Invocation:
  """`inspect_checkpoint maxtext OVERRIDES --summary [--train] [--topology] [--devices] [--device-memory]`."""

  overrides: tuple[str, ...]
  devices: int | None  # --devices as given (None when --topology names a slice)
  topology: str | None
  train: str | None
  device_memory: str | None
  compile: bool = False  # `--compile`: each printed line asks XLA again
  planning_limit: int | None = None  # plans against this many bytes per device instead (XLA-calibrated advice)

  def with_keys(self, keys: dict) -> Invocation:
    """The same line with each `key=value` of `keys` set (an earlier token for that key is dropped)."""
    kept = tuple(t for t in self.overrides if t.split("=", 1)[0] not in keys)
    return dataclasses.replace(self, overrides=kept + tuple(f"{k}={v}" for k, v in keys.items()))

  def with_devices(self, devices: int) -> Invocation:
    """The same line on `devices` devices: the slice name of that size of the same chip when there is one,
    else the chip's name with `--devices`; `--devices` alone when no topology was given."""
    if self.topology is None:
      return dataclasses.replace(self, devices=devices)
    chip = mesh_lib.topology_chip(self.topology).name
    per_slice, rest = divmod(devices, mesh_lib.num_slices(config_lib.resolve_config(self.overrides)))
    names = [name for name, n in mesh_lib.topologies().items()
             if n == per_slice and not rest and mesh_lib.topology_chip(name).name == chip]
    if names:
      return dataclasses.replace(self, topology=names[0], devices=None)
    return dataclasses.replace(self, topology=chip, devices=devices)

  def line(self) -> str:
    flags = ["--summary"]
    for flag, value in (("--train", self.train), ("--topology", self.topology), ("--devices", self.devices),
                        ("--device-memory", self.device_memory)):
      if value is not None:
        flags += [flag, str(value)]
    flags += ["--compile"] if self.compile else []
    return shlex.join(["inspect_checkpoint", "maxtext", *self.overrides, *flags])

  def memory(self, leaves):
    """(config, device count, per-device memory) of this line's plan for `leaves` (the parameter tree, which
    the keys advice changes leave as it is)."""
    cfg = config_lib.resolve_config(self.overrides)
    devices = devices_for(cfg, self.devices, self.topology)
    limit, source = limit_of(self.device_memory, self.topology)
    limit = self.planning_limit if self.planning_limit is not None else limit
    plan = placement.plan(leaves, cfg, devices)
    optimizer = memory_lib.optimizer_of(cfg, self.train)
    return cfg, devices, memory_lib.device_memory(leaves, plan, cfg, optimizer=optimizer, limit=limit,
                                                  limit_source=source, tpu=on_tpu(self.topology))
