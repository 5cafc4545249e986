"""Export stage 6, the report: what an export says about itself (`quantization_report.json`) and the summary.

The report holds the rules, coverage summary, each quantized weight (qtype, scale shape, granularity), the copied
leaves, the validation results, the producer, the source and the command.
"""

from __future__ import annotations

import datetime
import os
from typing import Sequence

from inspect_tool.paramtree import tree
from inspect_tool.fp8_export import write_orbax

FORMAT_VERSION = 1
STEP, ITEM = write_orbax.STEP, write_orbax.ITEM


def producer() -> dict:
  from importlib import metadata  # pylint: disable=import-outside-toplevel

  try:
    version = metadata.version("inspect-checkpoint")
  except metadata.PackageNotFoundError:
    version = "unknown"
  return {"name": "inspect_checkpoint", "version": version}


def _coverage_summary(report) -> dict:
  def group(g):
    return {"group": g.group, "weights": g.weights, "quantized_weights": g.quantized_weights, "params": g.params,
            "quantized_params": g.quantized_params, "params_share": round(g.params_share, 6),
            "flops_share": round(g.flops_share, 6)}
  return {"groups": [group(g) for g in report.groups], "total": group(report.total),
          "unused_rules": list(report.unused_rules), "other_params": report.other_params}


def build_report(plan, *, tokens: Sequence[str], source: str | None, command: str | None,
                 copied: Sequence[tree.Leaf], source_bytes: int, written_bytes: int, mesh_devices: int,
                 validation, validation_skipped: str | None = None, memory: dict | None = None,
                 dst: str | None = None) -> dict:
  """`quantization_report.json`: what was exported, how, from what, and what validation found (or why not)."""
  from quant import rules as rules_lib  # pylint: disable=import-outside-toplevel

  cfg = plan.cfg
  return {
      "format": {"version": FORMAT_VERSION, "layout": "orbax", "step": STEP, "item": ITEM,
                 "quantized": "<key>/array/qvalue (qtype, weight shape) + <key>/array/scale (weight rank, 1 on "
                              "shared axes, compute dtype): Qwix PTQ layout, dense and expert weights alike",
                 "copied": "unchanged (same key under params/params, same dtype)"},
      "producer": producer(),
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": command,
      "source": {"checkpoint": os.path.abspath(source) if source else None,
                 "init": None if source else f"random (seed {cfg.init_weights_seed})"},
      "config": {"overrides": list(tokens), "model_name": cfg.model_name, "quantization": cfg.quantization,
                 "quantize_mtp": cfg.quantize_mtp, "quantize_router_proj": cfg.quantize_router_proj,
                 "quantize_logits_proj": cfg.quantize_logits_proj, "scan_layers": cfg.scan_layers,
                 "param_scan_axis": cfg.param_scan_axis},
      "rules": [rules_lib.rule_record(r) for r in plan.rules],
      "coverage": _coverage_summary(plan.coverage),
      "weights": [wq.to_dict() for wq in sorted(plan.weights.values(),
                                                 key=lambda w: tree.natural_key("/".join(w.key)))],
      "copied": [{"key": "/".join(l.key), "shape": list(l.shape), "dtype": l.dtype} for l in copied],
      "bytes": {"source": source_bytes, "written": written_bytes},
      "mesh": {"devices": mesh_devices},
      "memory": memory or {},
      "validation": _validation_record(validation, validation_skipped, tokens, dst),
  }


def _validation_record(validation, skipped: str | None, tokens: Sequence[str], dst: str | None) -> dict:
  if validation is not None:
    return dict(validation.to_dict(), method="whole models, one at a time: the source (under the rules, then "
                                             "unquantized), then the export")
  record = {"skipped": True, "reason": skipped or "--no-validate"}
  if skipped and skipped != "--no-validate":
    record["run_elsewhere"] = f"inspect_checkpoint forward {' '.join(tokens)} --checkpoint {dst} --compare"
  return record


def format_text(result) -> str:
  """The summary `export` prints: what was written, and the validation table."""
  from inspect_tool.run import metrics  # pylint: disable=import-outside-toplevel
  from quant import coverage_format  # pylint: disable=import-outside-toplevel

  r = result.report
  quantized = r["weights"]
  params = sum(_prod(w["shape"]) for w in quantized)
  lines = [f"wrote {result.dst}",
           f"  {len(quantized)} weights quantized ({params:,} params, "
           f"{', '.join(sorted({w['qtype'] for w in quantized}))}), {len(r['copied'])} arrays copied",
           f"  {r['bytes']['source']:,} source bytes -> {r['bytes']['written']:,} written"]
  groups = r["coverage"]["groups"]
  lines.append("  coverage: " + ", ".join(f"{g['group']} {g['quantized_weights']}/{g['weights']} weights "
                                        f"({coverage_format.share_text(g['quantized_params'], g['params'])} of "
                                        "params)" for g in groups))
  v = result.validation
  if v is None:
    lines.append(f"validation skipped ({r['validation'].get('reason', '--no-validate')})")
    return "\n".join(lines) + "\n"
  lines.append(f"validation on a {v.batch_shape[0]}x{v.batch_shape[1]} batch ({v.tokens}):")
  lines.append("exported vs source under the same rules (gate: top-1 >= "
               f"{v.min_top1:g} for every head):")
  lines.append(metrics.format_comparisons(list(v.vs_quantized)).rstrip("\n"))
  lines.append("exported vs unquantized source (information):")
  lines.append(metrics.format_comparisons(list(v.vs_unquantized)).rstrip("\n"))
  lines.append("PASSED" if v.passed else f"FAILED: top-1 agreement below {v.min_top1:g}")
  return "\n".join(lines) + "\n"


def _prod(shape) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n
