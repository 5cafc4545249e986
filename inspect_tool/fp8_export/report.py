"""Export stage 6, the report: what an export says about itself (`quantization_report.json`) and the summary.

The report holds the rules, coverage summary, each quantized weight (qtype, scale shape, granularity), the copied
leaves, the validation results, the producer, the source and the command.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shlex
from typing import Any, Sequence

from inspect_tool.output import ours
from inspect_tool.paramtree import tree
from inspect_tool.report import coverage_format
from inspect_tool.streaming import write_orbax
from quant import metrics
from quant import rules as rules_lib

FORMAT_VERSION = 1
STEP, ITEM = write_orbax.STEP, write_orbax.ITEM


@dataclasses.dataclass(frozen=True)
class Origin:
  """Who wrote an export, when, by which command, from which weights (a checkpoint, or the seeded init)."""

  producer: dict
  created: str
  command: str | None
  checkpoint: str | None
  init: str | None

  def to_dict(self) -> dict:
    return {"producer": self.producer, "created": self.created, "command": self.command,
            "source": {"checkpoint": self.checkpoint, "init": self.init}}


def origin(cfg, source: str | None, command: str | None) -> Origin:
  """The `Origin` of an export made now by `command` from `source` (None: `cfg`'s seeded init)."""
  return Origin(ours.producer(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command, os.path.abspath(source) if source else None,
                None if source else f"random (seed {cfg.init_weights_seed})")


@dataclasses.dataclass(frozen=True)
class Validated:
  """The report's validation: its result (`validate.Validation`), or why it was skipped and how to run it
  elsewhere."""

  result: Any  # validate.Validation or None
  skipped: str | None = None
  rerun: str = ""

  def to_dict(self) -> dict:
    if self.result is not None:
      return self.result.to_dict()
    record = {"skipped": True, "reason": self.skipped or "--no-validate"}
    if self.skipped and self.skipped != "--no-validate":
      record["run_elsewhere"] = self.rerun
    return record


def _coverage_summary(report) -> dict:
  def group(g):
    return {"group": g.group, "weights": g.weights, "quantized_weights": g.quantized_weights, "params": g.params,
            "quantized_params": g.quantized_params, "params_share": round(g.params_share, 6),
            "flops_share": round(g.flops_share, 6)}
  return {"groups": [group(g) for g in report.groups], "total": group(report.total),
          "unused_rules": list(report.unused_rules), "other_params": report.other_params}


@dataclasses.dataclass
class ExportReport:
  """An Orbax export's report (`quantization_report.json` is `to_dict()`): what was exported, how, from what, and
  what validation found (or why not)."""

  origin: Origin
  tokens: tuple
  cfg: Any  # the exported config (`ModelConfig`)
  rules: tuple  # the quantization rules (qwix.QtRule)
  coverage: Any  # `report.coverage_report.CoverageReport`
  weights: tuple  # the quantized weights (`coverage.plan.WeightQuant`), in natural key order
  copied: tuple  # the leaves copied unchanged (`tree.Leaf`)
  source_bytes: int
  written_bytes: int
  mesh_devices: int
  memory: Any  # `pipeline.ExportMemory` or None
  validation: Validated
  manifest: dict | None = None  # the manifest's summary (`manifest.build`), once written

  def to_dict(self) -> dict:
    cfg = self.cfg
    document = {
        "format": {"version": FORMAT_VERSION, "layout": "orbax", "step": STEP, "item": ITEM,
                   "quantized": "<key>/array/qvalue (qtype, weight shape) + <key>/array/scale (weight rank, 1 on "
                                "shared axes, compute dtype): Qwix PTQ layout, dense and expert weights alike",
                   "copied": "unchanged (same key under params/params, same dtype)"},
        **self.origin.to_dict(),
        "config": {"overrides": list(self.tokens), "model_name": cfg.model_name, "quantization": cfg.quantization,
                   "quantize_mtp": cfg.quantize_mtp, "quantize_router_proj": cfg.quantize_router_proj,
                   "quantize_logits_proj": cfg.quantize_logits_proj, "scan_layers": cfg.scan_layers,
                   "param_scan_axis": cfg.param_scan_axis},
        "rules": [rules_lib.rule_record(r) for r in self.rules],
        "coverage": _coverage_summary(self.coverage),
        "weights": [wq.to_dict() for wq in self.weights],
        "copied": [{"key": "/".join(l.key), "shape": list(l.shape), "dtype": l.dtype} for l in self.copied],
        "bytes": {"source": self.source_bytes, "written": self.written_bytes},
        "mesh": {"devices": self.mesh_devices},
        "memory": self.memory.to_dict() if self.memory is not None else {},
        "validation": self.validation.to_dict(),
    }
    if self.manifest is not None:
      document["manifest"] = self.manifest
    return document


def build_report(plan, *, tokens: Sequence[str], source: str | None, command: str | None,
                 copied: Sequence[tree.Leaf], source_bytes: int, written_bytes: int, mesh_devices: int,
                 validation, validation_skipped: str | None = None, memory=None, rerun: str = "") -> ExportReport:
  """The `ExportReport` of an Orbax export of `plan` (`coverage.plan.ExportPlan`)."""
  return ExportReport(origin(plan.cfg, source, command), tuple(tokens), plan.cfg, tuple(plan.rules), plan.coverage,
                      tuple(sorted(plan.weights.values(), key=lambda w: tree.natural_key("/".join(w.key)))),
                      tuple(copied), source_bytes, written_bytes, mesh_devices, memory,
                      Validated(validation, validation_skipped, rerun))


@dataclasses.dataclass
class HfExportReport:
  """A Hugging Face export's report (`to_dict()`: its `quantization_report.json`): the layout, what its writer wrote
  (`write_hf.HfWritten`), where, within what memory, what reading decoded, and the validation."""

  origin: Origin
  tokens: tuple
  cfg: Any
  layout: Any  # `hf.layouts.HfLayout`
  written: Any  # `write_hf.HfWritten`
  dst: str
  max_memory: int
  decoding: dict  # `decoding`
  validation: Validated
  manifest: dict | None = None

  def to_dict(self) -> dict:
    document = {
        "format": {"version": FORMAT_VERSION, **self.layout.report_format()},
        **self.origin.to_dict(),
        "config": {"overrides": list(self.tokens), "model_name": self.cfg.model_name,
                   "quantization": self.cfg.quantization, "scan_layers": self.cfg.scan_layers},
        **self.written.summary(), "dst": self.dst, "max_memory": self.max_memory, "decoding": self.decoding,
        "validation": self.validation.to_dict(),
    }
    if self.manifest is not None:
      document["manifest"] = self.manifest
    return document


def decoding(decodes: dict, sizes: dict) -> dict:
  """What reading the source decoded, as counted at each read (`read.CheckpointSource.decodes`): chunks, bytes of
  the arrays inside them, the bytes of those arrays as stored (decoded size) and their ratio (1: every chunk
  decoded once; 2: twice, two-pass), overall and for the array read most often. `sizes`: key -> array bytes."""
  read = {key: counts for key, counts in decodes.items() if counts[0] and key in sizes}
  decoded = sum(counts[1] for counts in read.values())
  stored = sum(sizes[key] for key in read)
  ratios = {key: counts[1] / max(sizes[key], 1) for key, counts in read.items()}
  worst = max(ratios, key=ratios.get, default=None)
  return {"chunks_decoded": sum(counts[0] for counts in read.values()), "bytes_decoded": decoded,
          "bytes_stored": stored, "decoded_per_stored": round(decoded / stored, 4) if stored else 0.0,
          "most_decoded_array": None if worst is None else {"key": "/".join(worst),
                                                            "decoded_per_stored": round(ratios[worst], 4)},
          "arrays": len(read)}


def run_elsewhere(tokens: Sequence[str], dst: str | None, batch_options: Sequence[str] = ()) -> str:
  """The command that validates an Orbax export where the model fits (`batch_options`: the user's --tokens and
  --targets)."""
  return shlex.join(["inspect_checkpoint", "forward", *tokens, "--checkpoint", str(dst), *batch_options,
                     "--compare"])


def run_elsewhere_hf(tokens: Sequence[str], source: str | None, dst: str | None, *, layout, max_memory: int,
                     batch_options: Sequence[str] = (), max_kl: float | None = None) -> str:
  """A Hugging Face export (`layout`: `hf_layouts.HfLayout`) is validated by exporting it again where the models
  fit (`forward --compare` would compare the read-back export with itself): the same export with `max_memory`
  bytes (rounded up to whole GB), the user's --tokens/--targets (`batch_options`) and --max-kl."""
  return shlex.join(["inspect_checkpoint", "export", *tokens, *(["--checkpoint", source] if source else []),
                     "--output", str(dst), *layout.options(),
                     *batch_options, *(["--max-kl", f"{max_kl:g}"] if max_kl is not None else []),
                     "--overwrite", "--max-memory", f"{max(1, -(-max_memory // 10**9))}GB"])


def format_text(result) -> str:
  """The summary `export` prints: what was written, and the validation table."""
  r: ExportReport = result.report
  params = sum(_prod(w.shape) for w in r.weights)
  lines = [f"wrote {result.dst}",
           f"  {len(r.weights)} weights quantized ({params:,} params, "
           f"{', '.join(sorted({w.qtype for w in r.weights}))}), {len(r.copied)} arrays copied",
           f"  {r.source_bytes:,} source bytes -> {r.written_bytes:,} written"]
  lines.append("  coverage: " + ", ".join(f"{g.group} {g.quantized_weights}/{g.weights} weights "
                                        f"({coverage_format.share_text(g.quantized_params, g.params)} of "
                                        "params)" for g in r.coverage.groups))
  return "\n".join(lines + validation_lines(r.validation)) + "\n"


def format_hf_text(result) -> str:
  """The summary `export --layout deepseek-fp8` prints: what was written, and the validation table."""
  r: HfExportReport = result.report
  w, layout = r.written, r.layout.report_format()
  kind = ("bf16, unquantized" if layout["layout"] == "deepseek-bf16" else
          f"{w.num_fp4} fp4 experts with e8m0 scales per 32 values, {w.num_fp8} fp8 with 128x128 e8m0 block "
          "scales" if layout["layout"] == "deepseek-v4" else
          f"{w.num_fp8} fp8 with 128x128 block scales"
          + (" (powers of two, ue8m0)" if layout.get("scale_fmt") == "ue8m0" else ""))
  lines = [f"wrote {r.dst}: {w.num_tensors} tensors ({kind}) in {len(w.files)} file(s), {w.total_size:,} bytes"]
  return "\n".join(lines + validation_lines(r.validation)) + "\n"


def validation_lines(validated: Validated) -> list[str]:
  """The validation table (or why it was skipped)."""
  v = validated.result
  if v is None:
    return [f"validation skipped ({validated.skipped or '--no-validate'})"]
  return [f"validation on a {v.batch_shape[0]}x{v.batch_shape[1]} batch ({v.tokens}):",
          f"exported vs source under the export's numerics ({v.numerics}; gate: KL <= {v.max_kl:g} every head):",
          metrics.format_comparisons(list(v.vs_quantized)).rstrip("\n"),
          "exported vs unquantized source (information):",
          metrics.format_comparisons(list(v.vs_unquantized)).rstrip("\n"),
          "PASSED" if v.passed else f"FAILED: KL above {v.max_kl:g} nats ({_worst(v)})"]


def _worst(v) -> str:
  row = max(v.vs_quantized, key=lambda r: r.kl)
  return f"{row.head} {row.kl:.5g}"


def _prod(shape) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n
