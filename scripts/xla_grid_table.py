"""Our plan's per-device peak beside MaxText 0.2.5's XLA figures, one row per `train_compile` result JSON.

    .venv-py3.12/bin/python scripts/xla_grid_table.py [DIR_OR_JSON ...] [--markdown] [--parts] [--write]

DIR defaults to tests/data/xla_ref (the JSONs scripts/maxtext_compile_memory.py wrote). Ours: `inspect_checkpoint
maxtext KEYS --topology T --train adamw`'s needed bytes (state, gradients, the estimate); XLA's: code + arguments +
outputs - aliases + temporaries. A case XLA refused (its HBM OOM) shows XLA's own figure when its message has one.
`--write` rewrites inspect_tool/sharding/xla_grid.json (the table `maxtext --summary` names its nearest point from)
with these rows.
"""

import argparse
import json
import os
import sys

from inspect_tool.listings import grid_plan
from inspect_tool.output import atomic

GIB = 2**30
GRID_FILE = os.path.join(os.path.dirname(__file__), "..", "inspect_tool", "sharding", "xla_grid.json")
DATA = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "xla_ref")


def load(paths):
  return [dict(d, name=name) for name, d in grid_plan.results(*(paths or [DATA])).items()]


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
    mem = grid_plan.plan(d["keys"])
    needed = mem.needed
    xla = xla_peak(d)
    rows.append((d["name"], needed, xla, mem, d))
  if args.markdown:
    print("| grid point | model | topology | mesh | batch | length | remat | MTP | XLA peak (GiB) | plan (GiB) "
          "| plan / XLA | plan's peak phase |")
    print("|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---|")
  if args.write:
    points = [{"name": name, "keys": d["keys"], "xla_peak": d.get("peak_bytes") if d["ok"] else None,
               "oom_used": None if d["ok"] else xla,
               "oom_temp": None if d["ok"] else (d.get("oom_figures") or {}).get("temp_bytes"),
               "ours": int(needed)} for name, needed, xla, mem, d in rows]
    table = {"maxtext": "0.2.5", "libtpu": "0.0.50.1", "points": points}
    atomic.atomic_write_text(GRID_FILE, json.dumps(table, indent=1) + "\n")
  for name, needed, xla, mem, d in rows:
    ratio = f"{needed / xla:.3f}" if xla else "-"
    temps = (d.get("oom_figures") or {}).get("temp_bytes")
    xla_text = f"{xla / GIB:.2f}" if xla else f"refused (temporaries {temps / GIB:.2f})" if temps else "refused"
    if args.markdown:
      k = dict(key.split("=", 1) for key in d["keys"])
      mesh = " ".join(f"{key[4:-12]} {v}" for key, v in k.items() if key.startswith("ici_")) or "fsdp (all)"
      layers = f" L{k['base_num_decoder_layers']}" if "base_num_decoder_layers" in k else ""
      print(f"| {name} | {k['model_name']}{layers} | {k['compile_topology']} | {mesh} | "
            f"{k.get('per_device_batch_size', '12')} | {k.get('max_target_length', '2048')} | "
            f"{k.get('remat_policy', 'full')} | {k.get('mtp_num_layers', '0')} | {xla_text} | {needed / GIB:.2f} | "
            f"{ratio} | {mem.activations.phase} |")
    else:
      print(f"{name:50s} ours {needed / GIB:8.3f}  xla {xla_text:>8s}  ratio {ratio}  ({mem.activations.phase})")
      if args.parts:
        for part, b in mem.activations.parts:
          print(f"      {b / GIB:8.3f}  {part}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
