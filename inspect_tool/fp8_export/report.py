"""What an export says about itself: validation against its source, `quantization_report.json`, the summary.

Validation runs the source under the config's rules on the fly (Qwix QT: the quantization-applied model) and
unquantized, then the exported checkpoint loaded into the quantized model (`quantized_load`), one model after
the other, and compares them per head (main, each MTP depth): cosine, top-1 agreement, KL, relative error. The
gate (`min_top1`) is the top-1 agreement of every head with the quantization-applied source; the comparison
with the unquantized source is information (the cost of quantizing).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Sequence

from inspect_tool import progress
from inspect_tool import tree

FORMAT_VERSION = 1
DEFAULT_MIN_TOP1 = 0.9
STEP = 0
ITEM = "items"


@dataclasses.dataclass(frozen=True)
class Validation:
  """Exported model vs the source under the same rules (gated) and vs the unquantized source (information)."""

  vs_quantized: tuple  # metrics.HeadComparison per head
  vs_unquantized: tuple
  min_top1: float
  batch_shape: tuple[int, int]
  tokens: str  # "fixed" or the tokens file
  result: Any = dataclasses.field(default=None, compare=False, repr=False)  # the exported model's ForwardResult

  @property
  def passed(self) -> bool:
    return all(row.top1_agreement >= self.min_top1 for row in self.vs_quantized)

  def to_dict(self) -> dict:
    return {"batch_shape": list(self.batch_shape), "tokens": self.tokens, "min_top1": self.min_top1,
            "passed": self.passed, "gate": "top1_agreement of every head vs the source under the same rules (QT)",
            "vs_quantized_source": [r.to_dict() for r in self.vs_quantized],
            "vs_unquantized_source": [r.to_dict() for r in self.vs_unquantized]}


def validate(cfg, source: str | None, exported: str, data, *, min_top1: float = DEFAULT_MIN_TOP1, mesh=None,
             tokens: str = "fixed") -> Validation:
  """Runs source (QT and unquantized) and the exported checkpoint on `data` and compares them per head."""
  from inspect_tool import metrics  # pylint: disable=import-outside-toplevel
  from inspect_tool import quantized_load  # pylint: disable=import-outside-toplevel
  from inspect_tool import running  # pylint: disable=import-outside-toplevel

  model = running.load_model(cfg, source, mesh=mesh)
  quantized = running.forward(running.quantize_for_training(model, cfg), data)
  plain = running.forward(model, data)
  del model
  with progress.step("loading the exported checkpoint"):
    exported_model = quantized_load.load_quantized_model(cfg, exported, mesh=mesh)
  result = running.forward(exported_model, data)
  del exported_model
  return Validation(tuple(metrics.compare_heads(quantized, result)), tuple(metrics.compare_heads(plain, result)),
                    float(min_top1), tuple(int(d) for d in data.tokens.shape), tokens, result)


def _producer() -> dict:
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
                 validation: Validation | None) -> dict:
  from quant import rules as rules_lib  # pylint: disable=import-outside-toplevel

  cfg = plan.cfg
  return {
      "format": {"version": FORMAT_VERSION, "layout": "orbax", "step": STEP, "item": ITEM,
                 "quantized": "<key>/array/qvalue (qtype, weight shape) + <key>/array/scale (weight rank, 1 on "
                              "shared axes, compute dtype): Qwix PTQ layout, dense and expert weights alike",
                 "copied": "unchanged (same key under params/params, same dtype)"},
      "producer": _producer(),
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
      "validation": validation.to_dict() if validation is not None else {"skipped": True},
  }


def format_text(result) -> str:
  """The summary `export` prints: what was written, and the validation table."""
  from inspect_tool import metrics  # pylint: disable=import-outside-toplevel

  r = result.report
  quantized = r["weights"]
  params = sum(_prod(w["shape"]) for w in quantized)
  lines = [f"wrote {result.dst}",
           f"  {len(quantized)} weights quantized ({params:,} params, "
           f"{', '.join(sorted({w['qtype'] for w in quantized}))}), {len(r['copied'])} arrays copied",
           f"  {r['bytes']['source']:,} source bytes -> {r['bytes']['written']:,} written"]
  groups = r["coverage"]["groups"]
  lines.append("  coverage: " + ", ".join(f"{g['group']} {g['quantized_weights']}/{g['weights']} weights "
                                        f"({g['params_share']:.1%} of params)" for g in groups))
  v = result.validation
  if v is None:
    lines.append("validation skipped")
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
