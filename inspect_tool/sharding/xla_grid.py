"""The grid the estimate is calibrated on: MaxText 0.2.5's `train_compile` for TPU topologies, XLA's per-device
figures (`xla_grid.json`, made by scripts/xla_grid_table.py from scripts/maxtext_compile_memory.py's results), and
our plan's peak at each point as of that table (`tests/test_xla_grid.py` recomputes it: it must not go stale).

`nearest(overrides, topology)` names the grid point closest to a plan: the same `model_name` first, then the fewest
other model keys that differ (MTP depth, layer counts, ...), then the same topology, the same mesh keys, and the
fewest doublings of batch and length, a differing `remat_policy` counting as one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

from inspect_tool.paramtree import summary as summary_lib

GRID_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_grid.json")
_MESH_KEYS = ("ici_", "dcn_")
_RUN_KEYS = ("per_device_batch_size", "max_target_length", "remat_policy", "compile_topology",
             "compile_topology_num_slices")


@dataclasses.dataclass(frozen=True)
class GridPoint:
  name: str
  keys: tuple[str, ...]  # MaxText's overrides, compile_topology=T first
  xla_peak: int | None  # code + arguments + outputs - aliases + temporaries; None when XLA refused (OOM)
  ours: int  # our plan's needed bytes per device when the table was written
  oom_used: int | None = None  # XLA's figure from its HBM OOM message, when it gave one ("Used X of Y hbm")
  oom_temp: int | None = None  # ... its temporaries alone, when that is what it gave (libtpu 0.0.50's E1000)

  @property
  def topology(self) -> str:
    return self._value("compile_topology", "")

  def _value(self, key: str, default: str) -> str:
    return next((k.split("=", 1)[1] for k in self.keys if k.split("=", 1)[0] == key), default)

  def to_dict(self) -> dict:
    return {"name": self.name, "maxtext_keys": list(self.keys), "xla_peak_bytes": self.xla_peak,
            "xla_oom_bytes": self.oom_used, "xla_oom_temp_bytes": self.oom_temp, "ours_bytes": self.ours,
            "ratio": self.ours / self.xla_peak if self.xla_peak else None}

  def describe(self) -> str:
    """`NAME (MaxText 0.2.5 train_compile on T): ours X, XLA Y (ours/XLA r)`."""
    hb = summary_lib.human_bytes
    if self.xla_peak is None:
      figure = (f": {hb(self.oom_used)} needed" if self.oom_used else
                f": {hb(self.oom_temp)} of temporaries alone" if self.oom_temp else "")
      said = f"XLA refused it (HBM OOM{figure})"
      return f"{self.name} (MaxText 0.2.5 train_compile on {self.topology}): the plan there {hb(self.ours)}; {said}"
    return (f"{self.name} (MaxText 0.2.5 train_compile on {self.topology}): the plan there {hb(self.ours)}, "
            f"XLA {hb(self.xla_peak)} (ours/XLA {self.ours / self.xla_peak:.2f})")


@functools.lru_cache(maxsize=1)
def points() -> tuple[GridPoint, ...]:
  with open(GRID_FILE, encoding="utf-8") as f:
    rows = json.load(f)["points"]
  return tuple(GridPoint(r["name"], tuple(r["keys"]), r.get("xla_peak"), r["ours"], r.get("oom_used"),
                         r.get("oom_temp")) for r in rows)


def _split(tokens) -> tuple[dict, dict]:
  """(model keys, run keys) of `key=value` tokens: the run keys are batch, length, policy, topology and mesh."""
  model, run = {}, {}
  for token in tokens:
    key, _, value = token.partition("=")
    (run if key in _RUN_KEYS or key.startswith(_MESH_KEYS) else model)[key] = value
  return model, run


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
           len(set(p_model.items()) ^ set(model.items())), point.topology != (topology or ""),
           {k: v for k, v in p_run.items() if k.startswith(_MESH_KEYS)}
           != {k: v for k, v in run.items() if k.startswith(_MESH_KEYS)},
           _doublings(p_run.get("per_device_batch_size"), run.get("per_device_batch_size"), 12)
           + _doublings(p_run.get("max_target_length"), run.get("max_target_length"), 2048)
           + (p_run.get("remat_policy", "full") != run.get("remat_policy", "full")))
    if best_key is None or key < best_key:
      best, best_key = point, key
  return best
