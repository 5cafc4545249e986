"""The device mesh MaxText 0.2.5 builds from the `ici_*` / `dcn_*` keys, as axis sizes only (no devices).

MaxText maps each name of `mesh_axes` to a parallelism key (`stage` ← `*_pipeline_parallelism`, the others by
name); a name without a key has size 1. One `ici_*` value may be -1: it takes the devices per slice the others
leave (and must come out a whole number ≥ 1); the product must equal the devices per slice. On a single slice
the `dcn_*` values must all be 1 (the default `dcn_data_parallelism: -1` counts as 1): MaxText refuses
"DCN parallelism requested but only one slice available". With several slices (`num_slices`), `dcn_*` values
are filled the same way to the slice count and each mesh axis is `ici × dcn`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from inspect_tool import errors

# mesh axis → the suffix of its `ici_<suffix>_parallelism` / `dcn_<suffix>_parallelism` key (MaxText's maps).
AXIS_KEYS = {
    "diloco": "diloco", "data": "data", "stage": "pipeline", "fsdp": "fsdp", "fsdp_transpose": "fsdp_transpose",
    "sequence": "sequence", "context": "context", "context_usp_ulysses": "context_usp_ulysses",
    "context_autoregressive": "context_autoregressive", "tensor": "tensor", "tensor_sequence": "tensor_sequence",
    "model": "tensor", "expert": "expert", "autoregressive": "autoregressive",
}
# Axes MaxText's maps know without a key of their own (vLLM's; always size 1 here).
_SIZE_ONE_AXES = ("attn_dp", "attn_dp_expert", "dcp", "pcp")
# The dcn keys whose product MaxText checks against a single slice (every one but diloco).
_DCN_CHECKED = ("data", "pipeline", "fsdp", "fsdp_transpose", "sequence", "context", "context_usp_ulysses",
                "tensor", "tensor_sequence", "expert", "context_autoregressive", "autoregressive")
TOPOLOGY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "topologies.txt")


class ShardingError(errors.ConfigError):
  """A mesh, a device count or a sharding rule MaxText would not accept (exit 2)."""


@dataclasses.dataclass(frozen=True)
class Mesh:
  """Axis names in `mesh_axes` order and their sizes; `devices` is their product."""

  axes: tuple[str, ...]
  sizes: tuple[int, ...]

  @property
  def shape(self) -> dict[str, int]:
    return dict(zip(self.axes, self.sizes))

  @property
  def devices(self) -> int:
    return math.prod(self.sizes)

  def describe(self) -> str:
    """`fsdp=32 expert=8` (axes of size > 1 only), or `1 device` style text for an all-ones mesh."""
    big = [f"{a}={s}" for a, s in zip(self.axes, self.sizes) if s > 1]
    return " ".join(big) if big else "all axes 1"


_MEMORY_UNITS = {"GiB": 2**30, "GB": 10**9}


@dataclasses.dataclass(frozen=True)
class Chip:
  """One device of a `--topology`: its name (v5p, h100) and memory in bytes, and the text it was given as."""

  name: str
  memory: int
  memory_text: str


@functools.lru_cache(maxsize=None)
def _table() -> tuple[dict[str, tuple[int | None, str]], dict[str, Chip]]:
  topologies_, chips = {}, {}
  with open(TOPOLOGY_FILE, encoding="utf-8") as f:
    for line in f:
      if not line.strip() or line.startswith("#"):
        continue
      first, second, third = (line.split() + [""])[:3]
      if first == "chip":
        unit = next(u for u in _MEMORY_UNITS if third.endswith(u))
        chips[second] = Chip(second, int(float(third[:-len(unit)]) * _MEMORY_UNITS[unit]), third)
        topologies_[second] = (None, second)  # a chip's name alone: memory only, devices from --devices
      else:
        topologies_[first] = (int(second), third)
  return topologies_, chips


def topologies() -> dict[str, int | None]:
  """`--topology` names (MaxText's `compile_topology` names, and chip names) → devices per slice (None: a chip)."""
  return {name: devices for name, (devices, _) in _table()[0].items()}


def topology_devices(name: str) -> int | None:
  """Devices per slice of `--topology name`; None for a chip's name alone (v5p, h100)."""
  table = _table()[0]
  if name not in table:
    raise errors.UnknownKeyError(name, list(table), what="topology")
  return table[name][0]


def topology_chip(name: str) -> Chip:
  """The chip of `--topology name` (its per-device memory)."""
  topology_devices(name)
  return _table()[1][_table()[0][name][1]]


def _keys(prefix: str, names: list[str]) -> list[str]:
  """The parallelism key behind each mesh axis (`ici_fsdp_parallelism`); an axis without one keeps its name."""
  return [f"{prefix}_{AXIS_KEYS[n]}_parallelism" if n in AXIS_KEYS else n for n in names]


def _fill(values: list[int], target: int, kind: str, names: list[str]) -> list[int]:
  """MaxText's `fill_unspecified_mesh_axes`: resolve one -1, then require the product to equal `target`.

  Messages name the keys the user sets (`ici_fsdp_parallelism=3`), not the mesh axes behind them.
  """
  keys = _keys(kind.lower(), names)
  what = "slices" if kind == "DCN" else "devices per slice"
  for key, value in zip(keys, values):
    if value == 0 or value < -1:
      raise ShardingError(f"{key}={value}: a parallelism must be a positive integer, or -1 for the {what} the "
                          "others leave")
  if values.count(-1) > 1:
    unset = list(dict.fromkeys(k for k, v in zip(keys, values) if v == -1))
    raise ShardingError(f"{kind} parallelism: only one axis may be -1 (auto), got -1 for {', '.join(unset)}")
  if -1 in values:
    others = math.prod(v for v in values if v != -1)
    if target % others:
      given = " × ".join(f"{k}={v}" for k, v in dict(zip(keys, values)).items() if v > 1)
      raise ShardingError(f"{keys[values.index(-1)]}=-1 cannot be resolved: the {target} {what} are not a multiple "
                          f"of {given} = {others}; make them divide {target}")
    values = list(values)
    values[values.index(-1)] = target // others
  if math.prod(values) != target:
    given = [f"{k}={v}" for k, v in dict(zip(keys, values)).items() if v != 1] or [f"all {kind.lower()}_* 1"]
    product = f" = {math.prod(values)}" if len(given) > 1 else ""
    raise ShardingError(f"{' × '.join(given)}{product} does not match the {target} {what}; make the "
                        f"{kind.lower()}_* values multiply to it (or set one to -1)")
  return values


def num_slices(cfg) -> int:
  """MaxText's slice count: `num_slices`, else `compile_topology_num_slices`, else 1."""
  if int(cfg.num_slices) != -1:
    if int(cfg.num_slices) < 1:
      raise ShardingError(f"num_slices={cfg.num_slices}: the slice count must be a positive integer, or -1 "
                          "(MaxText's default: compile_topology_num_slices, else 1)")
    return int(cfg.num_slices)
  return int(cfg.compile_topology_num_slices) if int(cfg.compile_topology_num_slices) > 0 else 1


def _parallelism(cfg, prefix: str, axis: str) -> int:
  suffix = AXIS_KEYS.get(axis)
  return int(getattr(cfg, f"{prefix}_{suffix}_parallelism")) if suffix else 1


def ici_sizes(cfg, devices: int) -> list[int]:
  """The ICI axis sizes (one -1 filled) of `cfg`'s mesh on `devices` devices, in `mesh_axes` order."""
  axes = [str(a) for a in cfg.mesh_axes]
  return _fill([_parallelism(cfg, "ici", a) for a in axes], devices // num_slices(cfg), "ICI", axes)


def scaled(cfg, devices: int, axis: str, factor: int):
  """(config, devices) with the ICI size of mesh `axis` multiplied by `factor`, the other axes as they are."""
  axes = [str(a) for a in cfg.mesh_axes]
  sizes = ici_sizes(cfg, devices)
  keys = {}
  for name, size in zip(axes, sizes):
    if AXIS_KEYS.get(name):
      keys[f"ici_{AXIS_KEYS[name]}_parallelism"] = size * factor if name == axis else size
  return dataclasses.replace(cfg, passthrough={**dict(cfg.passthrough), **keys}), devices * factor


def build_mesh(cfg, devices: int) -> Mesh:
  """The mesh MaxText 0.2.5 makes for `cfg` on `devices` devices; `ShardingError` where MaxText refuses."""
  if devices < 1:
    raise ShardingError(f"--devices {devices}: the device count must be a positive integer")
  given = cfg.mesh_axes
  if not isinstance(given, (list, tuple)) or not all(isinstance(a, str) for a in given):
    raise ShardingError(f"mesh_axes={errors.shown(given)} is not a list of mesh axis names; known: "
                        f"{', '.join(AXIS_KEYS)}")
  axes = list(given)
  if not axes:
    raise ShardingError(f"mesh_axes={list(given)} names no axis; give MaxText's axes (known: "
                        f"{', '.join(AXIS_KEYS)})")
  if len(set(axes)) != len(axes):
    raise ShardingError(f"mesh_axes={errors.shown(axes)} names an axis twice")
  unknown = [a for a in axes if a not in AXIS_KEYS and a not in _SIZE_ONE_AXES]
  if unknown:
    raise ShardingError(f"mesh_axes: unknown axis {errors.shown(unknown[0])} (MaxText has no ici_/dcn_ key for it); "
                        f"known: {', '.join(AXIS_KEYS)}")
  slices = num_slices(cfg)
  if devices % slices:
    raise ShardingError(f"--devices {devices} is not divisible by num_slices={slices}")
  dcn_product = math.prod(int(getattr(cfg, f"dcn_{key}_parallelism")) for key in _DCN_CHECKED)
  if abs(dcn_product) > 1 and slices <= 1:
    given = ", ".join(f"dcn_{k}_parallelism={getattr(cfg, f'dcn_{k}_parallelism')}" for k in _DCN_CHECKED
                      if abs(int(getattr(cfg, f"dcn_{k}_parallelism"))) > 1)
    raise ShardingError(f"{given}: DCN parallelism requested but only one slice available (MaxText refuses it); "
                        "set num_slices>1 or use the ici_* keys")
  ici = _fill([_parallelism(cfg, "ici", a) for a in axes], devices // slices, "ICI", axes)
  sizes = ici
  if slices > 1:
    dcn = _fill([_parallelism(cfg, "dcn", a) for a in axes], slices, "DCN", axes)
    sizes = [i * d for i, d in zip(ici, dcn)]
  return Mesh(tuple(axes), tuple(sizes))
