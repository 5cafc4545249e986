"""What would make a plan that does not fit fit, each way as a whole `inspect_checkpoint maxtext ...` line whose
own plan (made again from that line, `invocation`) fits; a way whose line does not plan as fitting is not offered.

- The batch, on these devices, when the state fits but the step's temporaries (an estimate, `activations`) do
  not: the largest integer `per_device_batch_size` that fits, `remat_policy=full` (when another policy is set) with
  the largest batch that fits under it, and the largest power-of-two `max_target_length` that fits at the batch
  (at `per_device_batch_size=1` when even that batch does not fit).
- More devices of the same kind, keeping the parallelism's shape: one mesh axis grows (`fsdp`, or the largest axis
  when `fsdp` is 1), the others stay, and each device keeps its `per_device_batch_size`. The fewest devices are
  found by planning the grown mesh as MaxText would (every sharded dimension must divide) and summing its bytes, from
  the lower bound the bytes sharded over that axis give (the estimate's bf16 weight copies among them). When the
  step's temporaries alone fill a device at the configured batch, the devices are grown at
  `per_device_batch_size=1` instead: the batch and the device count together.
- `weight_dtype=bfloat16` halves the float32 parameters, their gradients and (`mu_dtype` unset) adamw's mu, on the
  same mesh (a figure, not a line: the checkpoint's dtype is the user's choice).
"""

from __future__ import annotations

import dataclasses
import math

from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import activations
from inspect_tool.sharding import invocation as invocation_lib
from inspect_tool.sharding import memory as memory_lib
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import placement

MAX_TRIES = 64  # grown meshes planned before giving up on divisibility
MIN_LENGTH = 16  # the shortest max_target_length offered
MAX_DEVICES = 1 << 16  # no device count above this is searched (beyond any slice or multi-slice job)


@dataclasses.dataclass(frozen=True)
class Way:
  """One way to fit: what changes, the line that plans it, and its bytes per device (checked: they fit)."""

  change: str
  line: str | None  # None when the plan's command line is unknown (`annotate` called without overrides)
  devices: int
  needed: float

  def to_dict(self) -> dict:
    return {"change": self.change, "command": self.line, "devices": self.devices, "bytes_per_device": self.needed}


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
  activations_fill: str | None = None  # when the step's temporaries do not fit: how much they take of what
  ways: tuple[Way, ...] = ()

  def notes(self) -> list[str]:
    """What the advice found, besides the ways with a command line."""
    hb = summary_lib.human_bytes
    out = [f"fits with {w.change}" for w in self.ways if not w.line]
    if self.devices is not None and not any(w.devices == self.devices for w in self.ways):
      grown = self.axis_size * self.devices // self.devices_now
      out.append(f"needs {self.devices} devices of this kind ({self.axis}={grown} instead of {self.axis_size}, the "
                 f"other axes unchanged: {hb(self.needed_there)} per device)")
    elif self.devices is None and self.why_not:
      out.append(f"at this batch no number of devices fits by growing {self.axis}: {self.why_not}")
    if self.bf16_needed is not None:
      out.append(f"weight_dtype=bfloat16 would {'fit' if self.bf16_fits else 'not fit'} on these devices "
                 f"({hb(self.bf16_needed)} per device)")
    return out

  def describe(self) -> str:
    """One line: why, each way with its command line, then the other notes."""
    why = [self.activations_fill] if self.activations_fill else []
    return "; ".join(why + [f"fits with {w.change}: {w.line}" for w in self.ways if w.line] + self.notes())

  def report_lines(self) -> list[str]:
    """The report's lines: each way's command on a line of its own, then the notes."""
    ways = [w for w in self.ways if w.line]
    out = [self.activations_fill[0].upper() + self.activations_fill[1:] + "."] if self.activations_fill else []
    out += ["To fit (each command runs as printed; its plan fits):"] if ways else []
    for w in ways:
      out += [f"  {w.change}:", f"    {w.line}"]
    notes = self.notes()
    if notes:
      out.append(("Also: " if ways else "To fit: ") + "; ".join(notes))
    return out

  def to_dict(self) -> dict:
    return {"axis": self.axis, "axis_size": self.axis_size, "devices_needed": self.devices,
            "bytes_per_device_there": self.needed_there, "why_not": self.why_not,
            "bf16_weights_bytes_per_device": self.bf16_needed, "bf16_weights_fit": self.bf16_fits,
            "activations_fill": self.activations_fill, "ways": [w.to_dict() for w in self.ways]}


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
                                  limit_source=mem.limit_source, tpu=_tpu(mem)), plan


def _grow(leaves, cfg, devices: int, mem, plan) -> tuple[str, int, int | None, float | None, str | None]:
  axis = _axis(plan.mesh)
  size = plan.mesh.shape[axis]
  start = 2
  if size > 1:  # bytes(k) = rest + (sharded + the estimate's share that follows the state) / k: the lower bound
    sharded = sum(b for key, b in mem.contributors if _on_axis(plan.placements[key].spec, axis))
    step = _fixed(mem)
    room = mem.limit - step - (mem.total.total - sharded)
    if room <= 0:
      hb = summary_lib.human_bytes
      return axis, size, None, None, (f"{hb(mem.total.total - sharded)} per device is not sharded over {axis} and "
                                      f"the step's temporaries take {hb(step)} (estimate)")
    start = max(2, math.ceil((sharded + mem.activation_bytes - step) / room))
    if devices * start > MAX_DEVICES:
      hb = summary_lib.human_bytes
      return axis, size, None, None, (f"{hb(sharded)} per device is sharded over {axis} and {hb(room)} is left for "
                                      f"it beside the step's temporaries ({hb(step)}, estimate): more than "
                                      f"{MAX_DEVICES} devices")
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


def _largest(fits, low: int, high: int) -> int | None:
  """The largest n in [low, high] with `fits(n)`, for `fits` true up to some n and false above it."""
  if high < low or not fits(low):
    return None
  while low < high:
    mid = (low + high + 1) // 2
    low, high = (mid, high) if fits(mid) else (low, mid - 1)
  return low


def _number(value: float) -> int | float:
  return int(value) if float(value).is_integer() else value


def _tpu(mem) -> bool:
  return mem.activations.layout.tpu if mem.activations is not None else True


def _fixed(mem) -> float:
  """The estimate's share that more devices leave as it is (its weight copies, padding and the scratch that follows
  the gradients shrink as a mesh axis grows)."""
  return mem.activations.fixed if mem.activations is not None else 0.0


def _batch_changes(cfg, room: float, mem) -> list[tuple[str, dict]]:
  """(what changes, the keys) that bring the step's estimate within `room` bytes on these devices."""
  batch, seq = float(cfg.per_device_batch_size), int(cfg.max_target_length)
  policy = str(getattr(cfg, "remat_policy", "full"))

  def fits(**kw):
    return activations.estimate(cfg, mem.activations.layout, gradients=mem.total.gradients, room=room,
                                **kw).total <= room

  out = []
  smaller = _largest(lambda b: fits(batch=b), 1, math.ceil(batch) - 1)
  if smaller is not None:
    out.append((f"per_device_batch_size={smaller} instead of {_number(batch)}", {"per_device_batch_size": smaller}))
  if policy != "full":
    under_full = _largest(lambda b: fits(batch=b, remat_policy="full"), 1, math.floor(batch)) if batch >= 1 else None
    if under_full is not None and under_full > (smaller or 0):
      keys = {"remat_policy": "full"} | ({} if under_full == batch else {"per_device_batch_size": under_full})
      out.append((f"remat_policy=full instead of {policy}"
                  + ("" if under_full == batch else f", per_device_batch_size={under_full}"), keys))
  at = batch if smaller is None and batch <= 1 or fits(batch=batch, seq=MIN_LENGTH) else 1.0
  exponent = _largest(lambda e: fits(batch=at, seq=2 ** e), MIN_LENGTH.bit_length() - 1,
                      max(seq - 1, 1).bit_length() - 1)
  if exponent is not None:
    keys = {"max_target_length": 2 ** exponent} | ({} if at == batch else {"per_device_batch_size": _number(at)})
    out.append((f"max_target_length={2 ** exponent} instead of {seq}"
                + ("" if at == batch else f", per_device_batch_size={_number(at)}"), keys))
  return out


XLA_SCALE = "the plan's scale, calibrated to XLA"  # `limit_source` of a plan whose limit is scaled to XLA's peak


def _fill_note(mem, room: float) -> str | None:
  """Says so when the step's temporaries are what does not fit: alone (their share that more devices would not
  shrink), beside a state that fits by itself, or taking most of a device."""
  if mem.activations is None or (room >= mem.activation_bytes and 2 * mem.activation_bytes < mem.limit):
    return None
  hb = summary_lib.human_bytes
  est = mem.activations
  at = (f"(estimate, per_device_batch_size={_number(est.batch)}, max_target_length={est.seq}, "
        f"remat_policy={est.remat_policy})")
  device = (f"the {hb(mem.limit)} a device holds on {XLA_SCALE}" if mem.limit_source == XLA_SCALE
            else f"its {hb(mem.limit)}")
  if _fixed(mem) >= mem.limit:
    return (f"the step's temporaries alone fill a device: {hb(_fixed(mem))} {at} of {device}, "
            "on any number of devices")
  return (f"the step's temporaries take {hb(mem.activation_bytes)} {at} of a device's {hb(mem.limit)}, leaving "
          f"{hb(mem.limit - mem.activation_bytes)} for the parameters, optimizer state and gradients, which need "
          f"{hb(mem.total.total)} here")


def _checked(ways, leaves, call) -> list[Way]:
  """The ways whose line, planned again, fits (`call` None: the ways as planned here, without lines)."""
  out = []
  for change, keys, devices, needed in ways:
    if call is None:
      out.append(Way(change, None, devices, needed))
      continue
    try:
      line = call.with_keys(keys)
      line = line.with_devices(devices) if devices is not None else line
      _, planned_devices, mem = line.memory(leaves)
    except mesh_lib.ShardingError:
      continue
    if mem.fits:
      out.append(Way(change, line.line(), planned_devices, mem.needed))
  return out


def _axis_keys(call, axis: str, grown: int) -> dict:
  """The grown axis's `ici_*_parallelism` key when the command line sets it (else MaxText fills it in)."""
  key = f"ici_{mesh_lib.AXIS_KEYS[axis]}_parallelism"
  given = call is not None and any(t.split("=", 1)[0] == key for t in call.overrides)
  return {key: grown} if given else {}


def _at_batch_one(leaves, cfg, plan, mem):
  one = dataclasses.replace(cfg, per_device_batch_size=1.0)
  return one, memory_lib.device_memory(leaves, plan, one, optimizer=mem.optimizer, limit=mem.limit, tpu=_tpu(mem),
                                       limit_source=mem.limit_source)


def advise(leaves, cfg, devices: int, mem, call: invocation_lib.Invocation | None = None) -> Advice:
  """The advice for `mem` (which does not fit) of `leaves` sharded for `cfg` on `devices` devices; `call` is the
  command line that planned it (each way's line is that line changed)."""
  plan = placement.plan(leaves, cfg, devices)
  room = mem.limit - mem.total.total
  ways = []  # (change, keys, devices or None, bytes per device)
  if mem.activations is not None and room > 0:
    ways += [(change, keys, None, None) for change, keys in _batch_changes(cfg, room, mem)]
  if mem.activations is not None and _fixed(mem) >= mem.limit:  # more devices cannot help
    axis = _axis(plan.mesh)
    size, needed_devices, needed_there, why_not = plan.mesh.shape[axis], None, None, None  # the fill note says why
  else:
    axis, size, needed_devices, needed_there, why_not = _grow(leaves, cfg, devices, mem, plan)
    if needed_devices is not None:
      ways.append((f"{needed_devices} devices ({axis}={size * needed_devices // devices})",
                   _axis_keys(call, axis, size * needed_devices // devices), needed_devices, needed_there))
  if not ways and mem.activations is not None and cfg.per_device_batch_size > 1:  # the batch and the devices
    one, one_mem = _at_batch_one(leaves, cfg, plan, mem)
    _, _, one_devices, one_there, _ = _grow(leaves, one, devices, one_mem, plan)
    if one_devices is not None:
      grown = size * one_devices // devices
      ways.append((f"per_device_batch_size=1 on {one_devices} devices ({axis}={grown})",
                   {"per_device_batch_size": 1} | _axis_keys(call, axis, grown), one_devices, one_there))
  bf16_needed = bf16_fits = None
  if any(leaf.is_param and leaf.dtype == "float32" for leaf in leaves):
    bf16_leaves = [dataclasses.replace(leaf, dtype="bfloat16") if leaf.is_param and leaf.dtype == "float32"
                   else leaf for leaf in leaves]
    bf16_cfg = dataclasses.replace(cfg, weight_dtype="bfloat16")
    bf16 = memory_lib.device_memory(bf16_leaves, plan, bf16_cfg, optimizer=mem.optimizer, limit=mem.limit,
                                    tpu=_tpu(mem))
    bf16_needed, bf16_fits = bf16.needed, bf16.fits
  return Advice(axis, size, devices, needed_devices, needed_there, why_not, bf16_needed, bf16_fits,
                _fill_note(mem, room), tuple(_checked(ways, leaves, call)))
