"""Our plan's per-device peak beside MaxText 0.2.5's XLA figures, one row per `train_compile` result JSON.

    .venv-py3.12/bin/python scripts/xla_grid_table.py [DIR_OR_JSON ...] [--markdown] [--parts] [--write]

DIR defaults to tests/data/xla (the JSONs scripts/maxtext_compile_memory.py wrote). Ours: `inspect_checkpoint
maxtext KEYS --topology T --train adamw`'s needed bytes (state, gradients, the estimate); XLA's: code + arguments +
outputs - aliases + temporaries. A case XLA refused (its HBM OOM) shows XLA's own figure when its message has one.
`--write` rewrites inspect_tool/sharding/xla_grid.json (the table `maxtext --summary` names its nearest point from)
with these rows.
"""

import argparse
import glob
import json
import os
import sys

from inspect_tool import sharding
from inspect_tool.configuration import config
from inspect_tool.listings import model_listing

GIB = 2**30
GRID_FILE = os.path.join(os.path.dirname(__file__), "..", "inspect_tool", "sharding", "xla_grid.json")


def load(paths):
  out = []
  for path in paths or [os.path.join(os.path.dirname(__file__), "..", "tests", "data", "xla")]:
    files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    for f in files:
      with open(f, encoding="utf-8") as fh:
        d = json.load(fh)
      if "keys" in d:
        d["name"] = os.path.basename(f)[:-5]
        out.append(d)
  return out


_LISTINGS = {}


def ours(keys):
  """(needed bytes, the memory record) of our plan for MaxText's keys."""
  topology = next(k.split("=", 1)[1] for k in keys if k.startswith("compile_topology="))
  overrides = [k for k in keys if not k.startswith("compile_topology")]
  cfg = config.resolve_config(overrides)
  model_keys = tuple(k for k in overrides if not k.startswith(("per_device_batch_size", "max_target_length",
                                                               "remat_policy")))
  if model_keys not in _LISTINGS:
    _LISTINGS[model_keys] = model_listing.model_listing(cfg, include_all=False, source="", key_filter=None,
                                                        fp8_column=False)[0]
  devices = sharding.devices_for(cfg, None, topology)
  report = sharding.annotate(_LISTINGS[model_keys], cfg, devices=devices, train="adamw", topology=topology)
  return report.memory.needed, report.memory


def xla_peak(d):
  if d["ok"]:
    return d["peak_bytes"]
  figures = d.get("oom_figures") or {}
  return figures.get("used_bytes")


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("paths", nargs="*")
  parser.add_argument("--markdown", action="store_true")
  parser.add_argument("--parts", action="store_true")
  parser.add_argument("--write", action="store_true")
  args = parser.parse_args(argv)
  rows = []
  for d in load(args.paths):
    if not d["ok"] and not d.get("oom"):
      continue
    needed, mem = ours(d["keys"])
    xla = xla_peak(d)
    rows.append((d["name"], needed, xla, mem, d))
  if args.markdown:
    print("| grid point | ours (GiB) | XLA (GiB) | ours / XLA |")
    print("|---|---:|---:|---:|")
  if args.write:
    points = [{"name": name, "keys": d["keys"], "xla_peak": d.get("peak_bytes") if d["ok"] else None,
               "oom_used": None if d["ok"] else xla, "ours": int(needed)} for name, needed, xla, mem, d in rows]
    with open(GRID_FILE, "w", encoding="utf-8") as f:
      json.dump({"maxtext": "0.2.5", "libtpu": "0.0.50.1", "points": points}, f, indent=1)
      f.write("\n")
  for name, needed, xla, mem, _ in rows:
    ratio = f"{needed / xla:.3f}" if xla else "-"
    xla_text = f"{xla / GIB:.2f}" if xla else "OOM"
    if args.markdown:
      print(f"| {name} | {needed / GIB:.2f} | {xla_text} | {ratio} |")
    else:
      print(f"{name:50s} ours {needed / GIB:8.3f}  xla {xla_text:>8s}  ratio {ratio}  ({mem.activations.phase})")
      if args.parts:
        for part, b in mem.activations.parts:
          print(f"      {b / GIB:8.3f}  {part}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
