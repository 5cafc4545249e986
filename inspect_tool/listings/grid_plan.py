"""Our plan for the keys of a MaxText `train_compile` run (`compile_topology=T` becomes `--topology T`, `opt_type=X`
(default adamw) `--train X`, as `maxtext KEYS --topology T --train X` plans it), and the result files that run
leaves (scripts/maxtext_compile_memory.py; ours: scripts/ours_compile_cases.py): what scripts/xla_grid_table.py and
tests/test_xla_grid.py set side by side.
"""

from __future__ import annotations

import functools
import glob
import json
import os

from inspect_tool import sharding
from inspect_tool.configuration import config
from inspect_tool.listings import model_listing

RUN_KEYS = ("per_device_batch_size", "max_target_length", "remat_policy", "opt_type")  # same model, planned again


def results(*paths: str) -> dict:
  """name → record of each `train_compile` result JSON in `paths` (directories or files; files without `ok` and
  `keys`, such as the device checks beside them, are not results)."""
  out = {}
  files = [f for p in paths for f in (sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p])]
  for path in files:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
    if "keys" in record and "ok" in record:
      out[os.path.basename(path)[:-5]] = record
  return out


def topology_of(keys) -> str:
  return next(k.split("=", 1)[1] for k in keys if k.startswith("compile_topology="))


def optimizer_of(keys) -> str:
  """MaxText's `opt_type` of the keys (its default, adamw, when they do not set it)."""
  return next((k.split("=", 1)[1] for k in keys if k.startswith("opt_type=")), "adamw")


@functools.lru_cache(maxsize=8)
def _listing(model_keys: tuple[str, ...]):
  cfg = config.resolve_config(list(model_keys))
  return model_listing.model_listing(cfg, include_all=False, source="", key_filter=None, fp8_column=False)[0]


def plan(keys):
  """The `DeviceMemory` our plan gives MaxText's `keys` (the model listed once per model keys)."""
  topology = topology_of(keys)
  overrides = [k for k in keys if not k.startswith("compile_topology")]
  cfg = config.resolve_config(overrides)
  listing = _listing(tuple(k for k in overrides if k.split("=", 1)[0] not in RUN_KEYS))
  devices = sharding.devices_for(cfg, None, topology)
  return sharding.annotate(listing, cfg, devices=devices, train=optimizer_of(keys), topology=topology).memory
