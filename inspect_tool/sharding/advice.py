"""What would make a plan that does not fit fit: more devices of the same kind, or bfloat16 weights.

More devices keep the parallelism's shape: one mesh axis grows (`fsdp`, or the largest axis when `fsdp` is 1),
the others stay, and each device keeps its `per_device_batch_size` (activations unchanged). The fewest devices
are found by planning the grown mesh as MaxText would (every sharded dimension must divide) and summing its bytes
exactly, from the lower bound the bytes sharded over that axis give. `weight_dtype=bfloat16` halves the float32
parameters, their gradients and (`mu_dtype` unset) adamw's mu, on the same mesh.
"""

from __future__ import annotations

import dataclasses
import math

from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import memory as memory_lib
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import placement

MAX_TRIES = 64  # grown meshes planned before giving up on divisibility


@dataclasses.dataclass(frozen=True)
class Advice:
  axis: str
  axis_size: int
  devices_now: int
  devices: int | None  # fewest devices (that axis grown) whose plan fits; None: none found
  needed_there: float | None  # bytes per device on that many devices
  why_not: str | None  # when `devices` is None
  bf16_needed: float | None  # bytes per device with weight_dtype=bfloat16 (None: the weights are already bf16)
  bf16_fits: bool | None

  def describe(self) -> str:
    hb = summary_lib.human_bytes
    if self.devices is not None:
      grown = self.axis_size * self.devices // self.devices_now
      out = (f"needs {self.devices} devices of this kind ({self.axis}={grown} instead of {self.axis_size}, the "
             f"other axes unchanged: {hb(self.needed_there)} per device)")
    else:
      out = f"no number of devices fits by growing {self.axis}: {self.why_not}"
    if self.bf16_needed is not None:
      out += (f"; weight_dtype=bfloat16 would {'fit' if self.bf16_fits else 'not fit'} on these devices "
              f"({hb(self.bf16_needed)} per device)")
    return out

  def to_dict(self) -> dict:
    return {"axis": self.axis, "axis_size": self.axis_size, "devices_needed": self.devices,
            "bytes_per_device_there": self.needed_there, "why_not": self.why_not,
            "bf16_weights_bytes_per_device": self.bf16_needed, "bf16_weights_fit": self.bf16_fits}


def _axis(mesh: mesh_lib.Mesh) -> str:
  shape = mesh.shape
  if shape.get("fsdp", 1) > 1 or max(mesh.sizes) == 1 and "fsdp" in shape:
    return "fsdp"
  return max(mesh.axes, key=lambda a: shape[a])


def _on_axis(spec, axis: str) -> bool:
  return any(entry == axis or isinstance(entry, tuple) and axis in entry for entry in spec)


def _memory(leaves, cfg, devices, mem):
  plan = placement.plan(leaves, cfg, devices)
  return memory_lib.device_memory(leaves, plan, cfg, optimizer=mem.optimizer, limit=mem.limit,
                                  limit_source=mem.limit_source), plan


def _grow(leaves, cfg, devices: int, mem, plan) -> tuple[str, int, int | None, float | None, str | None]:
  axis = _axis(plan.mesh)
  size = plan.mesh.shape[axis]
  start = 2
  if size > 1:  # bytes(k) = rest + sharded / k: the lower bound on k
    sharded = sum(b for key, b in mem.contributors if _on_axis(plan.placements[key].spec, axis))
    room = mem.limit - mem.activation_bytes - (mem.total.total - sharded)
    if room <= 0:
      hb = summary_lib.human_bytes
      return axis, size, None, None, (f"{hb(mem.total.total - sharded)} per device is not sharded over {axis} and "
                                      f"the activations take {hb(mem.activation_bytes)} (estimate)")
    start = max(2, math.ceil(sharded / room))
  planned = []
  for factor in range(start, start + MAX_TRIES):
    grown_cfg, grown_devices = mesh_lib.scaled(cfg, devices, axis, factor)
    try:
      grown, _ = _memory(leaves, grown_cfg, grown_devices, mem)
    except mesh_lib.ShardingError:
      continue  # a dimension the grown axis does not divide
    if grown.fits:
      return axis, size, grown_devices, grown.needed, None
    planned.append(size * factor)
  tried = f"{axis}={size * start} to {size * (start + MAX_TRIES - 1)}"
  if not planned:
    return axis, size, None, None, f"no {axis} size from {tried} divides every sharded dimension"
  return axis, size, None, None, (f"of {tried}, the sizes that divide every sharded dimension "
                                  f"({', '.join(map(str, planned[:3]))}{', ...' if len(planned) > 3 else ''}) "
                                  "do not fit")


def advise(leaves, cfg, devices: int, mem) -> Advice:
  """The advice for `mem` (which does not fit) of `leaves` sharded for `cfg` on `devices` devices."""
  plan = placement.plan(leaves, cfg, devices)
  axis, size, needed_devices, needed_there, why_not = _grow(leaves, cfg, devices, mem, plan)
  bf16_needed = bf16_fits = None
  if any(leaf.is_param and leaf.dtype == "float32" for leaf in leaves):
    bf16_leaves = [dataclasses.replace(leaf, dtype="bfloat16") if leaf.is_param and leaf.dtype == "float32"
                   else leaf for leaf in leaves]
    bf16_cfg = dataclasses.replace(cfg, weight_dtype="bfloat16")
    bf16 = memory_lib.device_memory(bf16_leaves, plan, bf16_cfg, optimizer=mem.optimizer, limit=mem.limit)
    bf16_needed, bf16_fits = bf16.needed, bf16.fits
  return Advice(axis, size, devices, needed_devices, needed_there, why_not, bf16_needed, bf16_fits)
