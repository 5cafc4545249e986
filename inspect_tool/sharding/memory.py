"""Bytes one device holds for a sharded MaxText tree: parameters, and for training optimizer state and gradients.

Every dimension is divided evenly (uneven shardings are refused upstream), so every device holds the same bytes:
the largest device is any device. Counted exactly, from shard shapes and dtypes:

- parameters (`nnx.Param`) at their stored dtype;
- with an optimizer (`--train` or MaxText's `opt_type`), sharded like the parameters as MaxText shards them:
  `adamw` (optax.adamw): mu at `mu_dtype` (MaxText: the weight dtype when unset), nu at the parameter's dtype;
  `adam_pax`: mu and nu at the parameter's dtype; `sgd` (optax.sgd, no momentum): none. Gradients: one
  parameter-dtype copy per parameter.

Estimated, and labelled so: with an optimizer, the training step's activations (`activations`: from
`per_device_batch_size`, `max_target_length`, `remat_policy` and the model's sizes). The verdict (`fits`) compares
the exact bytes plus that estimate with the memory of one device (`--device-memory`, else the chip's of
`--topology`).

Not counted (MaxText allocates them too): the optimizer's step counter, the non-Param gate bias, XLA's temporary
buffers beyond the activations; `opt_type=muon` is refused rather than guessed.
"""

from __future__ import annotations

import dataclasses

from inspect_tool import errors
from inspect_tool.configuration import sizes
from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import activations
from inspect_tool.sharding import mesh as mesh_lib

OPTIMIZERS = ("adamw", "adam_pax", "sgd")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
  """`95GiB`, `80GB`, `1.5TiB`, `1024` → bytes (a bare K, M, G, T: powers of 1024); `ShardingError` otherwise."""
  return sizes.parse_size(text, "--device-memory", _UNITS, mesh_lib.ShardingError, "95GiB, 80GB, 16384MiB")


def optimizer_of(cfg, train: str | None) -> str | None:
  """`--train X`, else MaxText's `opt_type` when the config sets it, else None (parameters only)."""
  name = train or (cfg.passthrough.get("opt_type") if hasattr(cfg, "passthrough") else None)
  if name is None:
    return None
  if bool(cfg.shard_optimizer_over_data):
    raise mesh_lib.ShardingError("shard_optimizer_over_data=true (Zero-1) shards the optimizer state over 'data' on "
                                 "top of the parameters' layout; per-device memory for it is not modelled")
  if name not in OPTIMIZERS:
    given = f"--train {name}" if train else f"opt_type={errors.shown(name)}"
    raise mesh_lib.ShardingError(f"{given}: per-device memory is modelled for {', '.join(OPTIMIZERS)}"
                                 + (" (muon's state layout is not modelled)" if name == "muon" else ""))
  return name


@dataclasses.dataclass(frozen=True)
class MemoryRow:
  group: str
  part: str  # "" for a group's total row
  params: float  # bytes per device
  optimizer: float
  gradients: float

  @property
  def total(self) -> float:
    return self.params + self.optimizer + self.gradients

  def to_dict(self) -> dict:
    return {"group": self.group, "part": self.part, "params_bytes": self.params,
            "optimizer_bytes": self.optimizer, "gradient_bytes": self.gradients, "total_bytes": self.total}


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """Per-device bytes by summary group, the total, and each parameter's share (largest first)."""

  rows: tuple[MemoryRow, ...]
  total: MemoryRow
  optimizer: str | None
  mu_dtype: str | None
  contributors: tuple[tuple[str, float], ...]  # (key, bytes per device), largest first
  limit: int | None = None
  activations: object = None  # activations.ActivationEstimate (with an optimizer), else None
  limit_source: str | None = None  # where `limit` came from: "--device-memory" or the --topology's chip
  advice: object = None  # advice.Advice when the plan does not fit
  grid_point: object = None  # xla_grid.GridPoint: the calibration grid's point nearest this plan

  @property
  def activation_bytes(self) -> float:
    return self.activations.total if self.activations is not None else 0.0

  @property
  def needed(self) -> float:
    """Exact bytes (parameters, optimizer state, gradients) plus the activation estimate."""
    return self.total.total + self.activation_bytes

  @property
  def fits(self) -> bool | None:
    return None if self.limit is None else self.needed <= self.limit

  def to_dict(self) -> dict:
    return {"optimizer": self.optimizer, "mu_dtype": self.mu_dtype, "groups": [r.to_dict() for r in self.rows],
            "total": self.total.to_dict(), "largest_device_bytes": self.total.total,
            "activations": self.activations.to_dict() if self.activations is not None else None,
            "needed_bytes": self.needed, "device_memory_bytes": self.limit, "device_memory_source": self.limit_source,
            "fits": self.fits, "advice": self.advice.to_dict() if self.advice is not None else None,
            "xla_grid_point": self.grid_point.to_dict() if self.grid_point is not None else None,
            "largest_contributors": [{"key": k, "bytes": b} for k, b in self.contributors[:10]]}


def _per_leaf(leaf, placement, optimizer: str | None, mu_dtype: str) -> tuple[float, float, float]:
  size = placement.shard_size
  params = size * summary_lib.dtype_bytes(leaf.dtype)
  if optimizer is None:
    return params, 0.0, 0.0
  if optimizer == "sgd":
    return params, 0.0, params
  mu = size * summary_lib.dtype_bytes(mu_dtype if optimizer == "adamw" else leaf.dtype)
  return params, mu + params, params


def device_memory(leaves, plan, cfg, *, optimizer: str | None = None, limit: int | None = None,
                  limit_source: str | None = None, classify=summary_lib.group_of, tpu: bool = True) -> DeviceMemory:
  """Sums one device's bytes over the Param `leaves` of `plan`, by the summary's groups; with an optimizer, adds
  the training step's estimate (`activations`; `tpu`: arrays sized in TPU tiles, as XLA lays them out there)."""
  mu_dtype = str(cfg.mu_dtype or cfg.weight_dtype)
  sums: dict[tuple[str, str], list[float]] = {}
  contributors = []
  for leaf in leaves:
    if not leaf.is_param:
      continue
    parts = _per_leaf(leaf, plan.of(leaf), optimizer, mu_dtype)
    contributors.append((leaf.dotted, sum(parts)))
    group, part = classify(leaf)
    for key in ((group, ""), (group, part)) if part else ((group, ""),):
      acc = sums.setdefault(key, [0.0, 0.0, 0.0])
      for i, value in enumerate(parts):
        acc[i] += value
  groups, parts = summary_lib.GROUP_ORDER, summary_lib.PART_ORDER
  keys = sorted(sums, key=lambda k: (groups.index(k[0]) if k[0] in groups else len(groups), k[1] != "",
                                     parts.index(k[1]) if k[1] in parts else len(parts)))
  rows = tuple(MemoryRow(g, p, *sums[(g, p)]) for g, p in keys)
  top = [r for r in rows if not r.part]
  total = MemoryRow("total", "", sum(r.params for r in top), sum(r.optimizer for r in top),
                    sum(r.gradients for r in top))
  contributors.sort(key=lambda kv: -kv[1])
  estimate = None
  if optimizer:
    layout = activations.layout_of(leaves, plan, cfg, optimizer=optimizer, tpu=tpu, mu_dtype=mu_dtype)
    room = None if limit is None else limit - total.total
    estimate = activations.estimate(cfg, layout, gradients=total.gradients, room=room)
  return DeviceMemory(rows, total, optimizer, mu_dtype if optimizer == "adamw" else None, tuple(contributors),
                      limit, estimate, limit_source or ("--device-memory" if limit is not None else None))


def overflow_message(mem: DeviceMemory, n: int = 3) -> str:
  """One line: needed vs available, the largest contributors, and what would fit."""
  hb = summary_lib.human_bytes
  top = ", ".join(f"{key} {hb(b)}" for key, b in mem.contributors[:n])
  estimate = (f" ({hb(mem.total.total)} exact + {hb(mem.activation_bytes)} the step's temporaries, estimated)"
              if mem.activations is not None else "")
  advice = f"; {mem.advice.describe()}" if mem.advice is not None else ""
  return (f"does not fit: each device needs {hb(mem.needed)} ({int(mem.needed)} B){estimate}, {mem.limit_source} "
          f"gives {hb(mem.limit)} ({mem.limit} B); largest contributors per device: {top}{advice}")
