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


@functools.lru_cache(maxsize=None)
def topologies() -> dict[str, int]:
  """`--topology` names (MaxText's `compile_topology` names) → devices per slice."""
  out = {}
  with open(TOPOLOGY_FILE, encoding="utf-8") as f:
    for line in f:
      if line.strip() and not line.startswith("#"):
        name, devices = line.split()[:2]
        out[name] = int(devices)
  return out


def topology_devices(name: str) -> int:
  table = topologies()
  if name not in table:
    raise errors.UnknownKeyError(name, list(table), what="topology")
  return table[name]


def _fill(values: list[int], target: int, kind: str, names: list[str]) -> list[int]:
  """MaxText's `fill_unspecified_mesh_axes`: resolve one -1, then require the product to equal `target`."""
  if values.count(-1) > 1:
    unset = [n for n, v in zip(names, values) if v == -1]
    raise ShardingError(f"{kind} parallelism: only one axis may be -1 (auto), got -1 for {', '.join(unset)}")
  if -1 in values:
    others = math.prod(v for v in values if v != -1)
    if others <= 0 or target % others or target // others < 1:
      raise ShardingError(f"{kind} parallelism: the -1 axis ({names[values.index(-1)]}) cannot be resolved: "
                          f"{target} {'slices' if kind == 'DCN' else 'devices per slice'} / {others} (the other "
                          "axes) is not a whole number")
    values = list(values)
    values[values.index(-1)] = target // others
  if math.prod(values) != target or any(v < 1 for v in values):
    given = " × ".join(f"{n}={v}" for n, v in zip(names, values) if v != 1) or "1"
    raise ShardingError(f"{kind} parallelism {given} = {math.prod(values)} does not match the "
                        f"{target} {'slices' if kind == 'DCN' else 'devices per slice'}; make the {kind.lower()}_* "
                        "values multiply to it (or set one to -1)")
  return values


def _parallelism(cfg, prefix: str, axis: str) -> int:
  suffix = AXIS_KEYS.get(axis)
  return int(getattr(cfg, f"{prefix}_{suffix}_parallelism")) if suffix else 1


def num_slices(cfg) -> int:
  """MaxText's slice count: `num_slices`, else `compile_topology_num_slices`, else 1."""
  if int(cfg.num_slices) != -1:
    return int(cfg.num_slices)
  return int(cfg.compile_topology_num_slices) if int(cfg.compile_topology_num_slices) > 0 else 1


def build_mesh(cfg, devices: int) -> Mesh:
  """The mesh MaxText 0.2.5 makes for `cfg` on `devices` devices; `ShardingError` where MaxText refuses."""
  if devices < 1:
    raise ShardingError(f"--devices {devices}: the device count must be a positive integer")
  given = cfg.mesh_axes
  if not isinstance(given, (list, tuple)) or not all(isinstance(a, str) for a in given):
    raise ShardingError(f"mesh_axes={errors.shown(given)} is not a list of mesh axis names; known: "
                        f"{', '.join(AXIS_KEYS)}")
  axes = list(given)
  if len(set(axes)) != len(axes):
    raise ShardingError(f"mesh_axes={errors.shown(axes)} names an axis twice")
  unknown = [a for a in axes if a not in AXIS_KEYS and a not in _SIZE_ONE_AXES]
  if unknown:
    raise ShardingError(f"mesh_axes: unknown axis {errors.shown(unknown[0])} (MaxText has no ici_/dcn_ key for it); "
                        f"known: {', '.join(AXIS_KEYS)}")
  slices = num_slices(cfg)
  if slices < 1 or devices % slices:
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
