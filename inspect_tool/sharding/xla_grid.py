"""The grid the estimate is calibrated on: MaxText 0.2.5's `train_compile` for TPU topologies, XLA's per-device
figures (`xla_grid.json`, made by scripts/xla_grid_table.py from scripts/maxtext_compile_memory.py's results), and
our plan's peak at each point as of that table (`tests/test_xla_grid.py` recomputes it: it must not go stale).

Held out: a point whose name hashes to 0 or 1 modulo 5 (`held_out`, about two in five, fixed by the name alone, so
no one chooses them) is never used to fit the estimate's coefficients; the table reports those points apart.

`nearest(overrides, topology)` names the grid point closest to a plan: the same `model_name` first, then the fewest
other model keys that differ (MTP depth, layer counts, ...), then the same chip, the same topology, the same mesh
keys, and the fewest doublings of batch and length, a differing `remat_policy` or `opt_type` counting as one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os

from inspect_tool.paramtree import summary as summary_lib

GRID_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_grid.json")
_MESH_KEYS = ("ici_", "dcn_")
_RUN_KEYS = ("per_device_batch_size", "max_target_length", "remat_policy", "opt_type", "compile_topology",
             "compile_topology_num_slices")


def held_out(name: str) -> bool:
  """Whether the grid point `name` is kept out of every fit (module docstring)."""
  return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 5 < 2


@dataclasses.dataclass(frozen=True)
class GridPoint:
  name: str
  keys: tuple[str, ...]  # MaxText's overrides, compile_topology=T first
  xla_peak: int | None  # code + arguments + outputs - aliases + temporaries; None when XLA refused (OOM)
  ours: int  # our plan's needed bytes per device when the table was written
  oom_used: int | None = None  # XLA's figure from its HBM OOM message, when it gave one ("Used X of Y hbm")
  oom_temp: int | None = None  # ... its temporaries alone, when that is what it gave (libtpu 0.0.50's E1000)
  held_out: bool = False  # kept out of the estimate's fit (`held_out`)

  @property
  def topology(self) -> str:
    return self._value("compile_topology", "")

  def _value(self, key: str, default: str) -> str:
    return next((k.split("=", 1)[1] for k in self.keys if k.split("=", 1)[0] == key), default)

  def to_dict(self) -> dict:
    return {"name": self.name, "maxtext_keys": list(self.keys), "xla_peak_bytes": self.xla_peak,
            "xla_oom_bytes": self.oom_used, "xla_oom_temp_bytes": self.oom_temp, "ours_bytes": self.ours,
            "ratio": self.ours / self.xla_peak if self.xla_peak else None, "held_out": self.held_out}

  def describe(self) -> str:
    """`NAME (MaxText 0.2.5 train_compile on T): the plan there X, XLA Y (ours/XLA r; held out of the plan's fit)`."""
    hb = summary_lib.human_bytes
    fit = "held out of the plan's fit" if self.held_out else "a point the plan was fitted on"
    if self.xla_peak is None:
      figure = (f": {hb(self.oom_used)} needed" if self.oom_used else
                f": {hb(self.oom_temp)} of temporaries alone" if self.oom_temp else "")
      said = f"XLA refused it (HBM OOM{figure}; {fit})"
      return f"{self.name} (MaxText 0.2.5 train_compile on {self.topology}): the plan there {hb(self.ours)}; {said}"
    return (f"{self.name} (MaxText 0.2.5 train_compile on {self.topology}): the plan there {hb(self.ours)}, "
            f"XLA {hb(self.xla_peak)} (ours/XLA {self.ours / self.xla_peak:.2f}; {fit})")


@functools.lru_cache(maxsize=1)
def points() -> tuple[GridPoint, ...]:
  with open(GRID_FILE, encoding="utf-8") as f:
    rows = json.load(f)["points"]
  return tuple(GridPoint(r["name"], tuple(r["keys"]), r.get("xla_peak"), r["ours"], r.get("oom_used"),
                         r.get("oom_temp"), bool(r.get("held_out"))) for r in rows)


def _split(tokens) -> tuple[dict, dict]:
  """(model keys, run keys) of `key=value` tokens: the run keys are batch, length, policy, topology and mesh."""
  model, run = {}, {}
  for token in tokens:
    key, _, value = token.partition("=")
    (run if key in _RUN_KEYS or key.startswith(_MESH_KEYS) else model)[key] = value
  return model, run


def _chip(topology: str | None) -> str:
  """The chip family of a TPU slice name (`v5p-8` → `v5p`)."""
  return (topology or "").split("-", 1)[0]


def _doublings(a: str | None, b: str | None, default: float) -> float:
  x, y = float(a or default), float(b or default)
  return abs(math.log2(max(x, 1e-9) / max(y, 1e-9)))


def nearest(overrides, topology: str | None) -> GridPoint | None:
  """The grid point closest to the plan of `overrides` on `topology` (module docstring); None without a grid."""
  model, run = _split(overrides)
  best, best_key = None, None
  for point in points():
    p_model, p_run = _split(point.keys)
    key = (p_model.get("model_name") != model.get("model_name"),
           len(set(p_model.items()) ^ set(model.items())), _chip(point.topology) != _chip(topology),
           point.topology != (topology or ""),
           {k: v for k, v in p_run.items() if k.startswith(_MESH_KEYS)}
           != {k: v for k, v in run.items() if k.startswith(_MESH_KEYS)},
           _doublings(p_run.get("per_device_batch_size"), run.get("per_device_batch_size"), 12)
           + _doublings(p_run.get("max_target_length"), run.get("max_target_length"), 2048)
           + (p_run.get("remat_policy", "full") != run.get("remat_policy", "full"))
           + (p_run.get("opt_type", "adamw") != (run.get("opt_type") or "adamw")))
    if best_key is None or key < best_key:
      best, best_key = point, key
  return best
