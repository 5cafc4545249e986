"""The grid's table (docs/xla-grid.md, written by scripts/xla_grid_table.py): at every point, MaxText 0.2.5's XLA
figures for its own `train_compile`, ours for `maxtext KEYS --topology T --compile --train OPT`, and the plan's.

A point is a MaxText result (tests/data/xla_ref/NAME.json, the grid the plan is held to, and
tests/data/xla_family/NAME.json, the family grid: compiled, or refused by XLA for lack of HBM); ours is
tests/data/xla_ours/NAME.json when it was compiled (scripts/ours_compile_cases.py). Ratios are over MaxText's
figures: our peak (code + arguments + outputs - aliases + temporaries) and arguments, and the plan's needed bytes.
Points `xla_grid.held_out` names are kept out of the estimate's fit and summarised apart.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

from inspect_tool.listings import grid_plan
from inspect_tool.sharding import xla_grid

GIB = 2**30
PEAK_TOLERANCE, ARGS_TOLERANCE, PLAN_TOLERANCE = 0.05, 0.01, 0.15


@dataclasses.dataclass(frozen=True)
class Row:
  """One grid point: MaxText's record, ours (None when not compiled), the plan's `DeviceMemory`."""

  name: str
  maxtext: dict
  ours: dict | None
  plan: object

  @property
  def keys(self) -> dict:
    return dict(k.split("=", 1) for k in self.maxtext["keys"])

  @property
  def held_out(self) -> bool:
    return xla_grid.held_out(self.name)

  @property
  def mt_peak(self) -> int | None:
    return self.maxtext.get("peak_bytes") if self.maxtext["ok"] else None

  @property
  def mt_args(self) -> int | None:
    return self.maxtext["memory_analysis"]["argument_size_in_bytes"] if self.maxtext["ok"] else None

  @property
  def ours_peak(self) -> int | None:
    return ((self.ours or {}).get("xla") or {}).get("peak_bytes")

  @property
  def ours_args(self) -> int | None:
    return ((self.ours or {}).get("xla") or {}).get("argument_size_in_bytes")

  def ratio(self, ours: float | None) -> float | None:
    return ours / self.mt_peak if ours and self.mt_peak else None

  @property
  def plan_ratio(self) -> float | None:
    return self.ratio(self.plan.needed)


def rows(maxtext_dirs, ours_dir: str | None) -> list[Row]:
  """The grid's rows: every MaxText result in `maxtext_dirs` (one directory or several) that compiled or that XLA
  refused for lack of HBM."""
  ours = grid_plan.results(ours_dir) if ours_dir and os.path.isdir(ours_dir) else {}
  dirs = [maxtext_dirs] if isinstance(maxtext_dirs, str) else list(maxtext_dirs)
  out = []
  for name, record in grid_plan.results(*dirs).items():
    if record["ok"] or record.get("oom"):
      out.append(Row(name, record, ours.get(name), grid_plan.plan(record["keys"])))
  return out


def _cell(value, fmt="{:.2f}"):
  return "-" if value is None else fmt.format(value)


def _mesh(keys: dict) -> str:
  return " ".join(f"{k[4:-12]} {v}" for k, v in keys.items() if k.startswith("ici_")) or "fsdp (all)"


def _model(keys: dict) -> str:
  extra = [f"L{keys['base_num_decoder_layers']}"] if "base_num_decoder_layers" in keys else []
  if "base_emb_dim" in keys:
    extra = [f"E{keys['base_emb_dim']}"] + extra
  if keys.get("attention") and keys["attention"] != "autoselected":
    extra.append(keys["attention"] + (" tokamax" if keys.get("use_tokamax_splash") == "true" else ""))
  return " ".join([keys["model_name"]] + extra)


def _peak_cell(row: Row, figure: int | None, record: dict | None) -> str:
  if figure is not None:
    return f"{figure / GIB:.2f}"
  if record is None:
    return "-"
  temps = (record.get("oom_figures") or {}).get("temp_bytes") or (record.get("xla") or {}).get("xla_temporaries_bytes")
  return f"refused (temporaries {temps / GIB:.2f})" if temps else "refused" if row is not None else "-"


def line(row: Row) -> str:
  k = row.keys
  ours = row.ratio(row.ours_peak)
  args = row.ours_args / row.mt_args if row.ours_args and row.mt_args else None
  return (f"| {row.name} | {_model(k)} | {k['compile_topology']} | {_mesh(k)} | {k.get('opt_type', 'adamw')} | "
          f"{k.get('per_device_batch_size', '12')} | {k.get('max_target_length', '2048')} | "
          f"{k.get('remat_policy', 'full')} | {k.get('mtp_num_layers', '0')} | "
          f"{_peak_cell(row, row.mt_peak, row.maxtext)} | {_peak_cell(row, row.ours_peak, row.ours)} | "
          f"{_cell(ours, '{:.3f}')} | {_cell(args, '{:.4f}')} | {row.plan.needed / GIB:.2f} | "
          f"{_cell(row.plan_ratio, '{:.3f}')} | {'held out' if row.held_out else 'fit'} |")


def _spread(ratios) -> str:
  if not ratios:
    return "none"
  worst = max(ratios, key=lambda r: abs(r - 1))
  return (f"{len(ratios)} points, median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}, "
          f"worst {worst:.3f}")


def summary(table: list[Row]) -> list[str]:
  """The lines above the table: how close ours and the plan are, held-out points apart."""
  ours = [r.ratio(r.ours_peak) for r in table if r.ratio(r.ours_peak)]
  args = [r.ours_args / r.mt_args for r in table if r.ours_args and r.mt_args]
  within = sum(abs(x - 1) <= PEAK_TOLERANCE for x in ours)
  args_within = sum(abs(x - 1) <= ARGS_TOLERANCE for x in args)
  out = [f"- Our `--compile` peak over MaxText's: {_spread(ours)}; within {PEAK_TOLERANCE:.0%}: {within} of "
         f"{len(ours)}. Arguments: within {ARGS_TOLERANCE:.0%} on {args_within} of {len(args)}."]
  for label, held in (("held out of the fit", True), ("fitted on", False)):
    plan = [r.plan_ratio for r in table if r.held_out == held and r.plan_ratio]
    good = sum(abs(x - 1) <= PLAN_TOLERANCE for x in plan)
    out.append(f"- The plan over MaxText's peak, points {label}: {_spread(plan)}; within {PLAN_TOLERANCE:.0%}: "
               f"{good} of {len(plan)}.")
  return out


HEADER = ("| grid point | model | topology | mesh | optimizer | batch | length | remat | MTP | MaxText peak (GiB) | "
          "ours (GiB) | ours / MaxText | arguments ours / MaxText | plan (GiB) | plan / MaxText | plan's set |\n"
          "|---|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")


def markdown(table: list[Row], intro: str) -> str:
  """The whole of docs/xla-grid.md: `intro`, the summary, the table (one line per point, by name)."""
  body = [line(r) for r in sorted(table, key=lambda r: r.name)]
  return "\n".join([intro.rstrip(), "", *summary(table), "", HEADER, *body]) + "\n"
