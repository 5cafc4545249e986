"""The parameter listing report: MaxText's `key: … | shape: … | dtype: …` lines, JSON and Markdown.

One `ParamReport` serves the `maxtext`, `orbax` and `hf` commands; the formatters below never compute
anything the report does not already hold.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from inspect_tool.paramtree import collapse as collapse_lib
from inspect_tool.paramtree import fp8_size
from inspect_tool.paramtree import select
from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.paramtree import tree
from inspect_tool.report import glance_format
from inspect_tool.report import sharding_format

SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ParamReport:
  """What a listing command found: sorted leaves, the parameter summary and notes for the reader."""

  source: str  # what was inspected: a model spec or a path
  leaves: tuple[tree.Leaf, ...]
  summary: summary_lib.Summary
  notes: tuple[str, ...] = ()
  grouped: bool = False  # `--all`: arrays grouped by checkpoint item, each group headed by a comment line
  config: dict | None = None  # the model config (`maxtext`): echoed by the JSON format
  sharding: Any = None  # `sharding.placement.ShardingPlan` (`--devices`): spec and shard shape per leaf
  memory: Any = None  # `sharding.memory.DeviceMemory`: bytes per device by group
  key_filter: select.KeyFilter | None = None  # `--filter`: leaves and totals are those it matched
  collapse: bool = False  # `--collapse`: repeated layers and experts as one line per stack
  xla: Any = None  # `xla_compile.report.XlaVerdict` (`--compile`): XLA's per-device memory and verdict
  glance: tuple = ()  # `coverage_verdict.Verdict`s of the config's quantization (`maxtext --chip`), () without one
  chip: Any = None  # `chip_fit.ChipFit` (`maxtext --chip` / `--topology`): how they run on that chip

  @property
  def items(self) -> list[str]:
    seen: list[str] = []
    for leaf in self.leaves:
      if leaf.item not in seen:
        seen.append(leaf.item)
    return seen


def build_report(source: str, leaves, *, include_all: bool, routed_fraction: float | None = None,
                 notes=(), count_all: bool = False, classify=summary_lib.group_of, config=None,
                 key_filter: select.KeyFilter | None = None, fp8=None) -> ParamReport:
  """Sorts and filters leaves (`params.*` only unless `include_all`; `key_filter`) and computes the summary.

  The total counts `params.params.*` leaves (MaxText's convention), or every leaf with `count_all` (HF files);
  FP8 scales (`select.scale_keys`) apart from parameters; with a filter, only the leaves it matched. `fp8`
  (`fp8_size.Fp8Sizing`) sizes the summary's fp8 column (None: unknown, or as stored when the leaves hold scales).
  """
  leaves = list(leaves)
  scales = select.scale_keys(leaves)
  if fp8 is None and scales:
    fp8 = fp8_size.as_stored(len(scales))
  chosen, key_filter = select.apply(key_filter, [leaf for leaf in leaves if include_all or count_all
                                                 or leaf.item == "params"])
  if key_filter is not None:
    leaves, _ = select.apply(key_filter, leaves)
  ordered = tree.sort_leaves(chosen)
  grouped = include_all and not count_all
  if grouped:  # group by item, params first, keeping natural order inside each item
    items = sorted({leaf.item for leaf in ordered}, key=lambda item: (item != "params", item))
    ordered = [leaf for item in items for leaf in ordered if leaf.item == item]
  summary = summary_lib.summarize(leaves, routed_fraction=routed_fraction, all_leaves=count_all,
                                  classify=classify, scales=scales, fp8=fp8)
  return ParamReport(source, tuple(ordered), summary, tuple(notes), grouped, config, key_filter=key_filter)


def _shape(shape) -> str:
  return str(tuple(int(d) for d in shape))


def leaf_line(leaf: tree.Leaf, check_dtype: bool, placement=None) -> str:
  line = f"key: {leaf.dotted} | shape: {_shape(leaf.shape)}"
  line = f"{line} | dtype: {leaf.dtype}" if check_dtype else line
  return f"{line} | spec: {placement.spec_text()} | shard: {_shape(placement.shard_shape)}" if placement else line


def _placement(report: ParamReport, leaf: tree.Leaf):
  return report.sharding.of(leaf) if report.sharding is not None else None


def total_line(total: int) -> str:
  """MaxText's own total line (kept byte for byte)."""
  return f"Total Parameters: {total} (~{total / 1e9:.2f} B)"


def totals_text(report: ParamReport) -> str:
  """Our totals in human units: parameters, scales apart, bytes as stored; says when a filter chose them."""
  s, h = report.summary, summary_lib.human
  text = f"{h(s.total_params, ' ')} parameters"
  text += f" + {h(s.total_scales, ' ')} scale values (FP8 scales, counted apart)" if s.total_scales else ""
  text += f", {summary_lib.human_bytes(s.total_bytes)} as stored"
  if report.key_filter is not None:
    return f"Total shown ({report.key_filter.describe()}): {s.total_params} = {text}"
  return f"Total: {text}"


def total_lines(report: ParamReport) -> list[str]:
  """MaxText's `Total Parameters` line then ours; filtered, only ours (a filtered total is not the model's)."""
  if report.key_filter is not None:
    return [totals_text(report)]
  return [total_line(report.summary.total_params), totals_text(report)]


def _signature(report: ParamReport):
  def signature(leaf: tree.Leaf):
    placement = _placement(report, leaf)
    return leaf.item, (placement.spec_text(), tuple(placement.shard_shape)) if placement else None
  return signature


def stacks(report: ParamReport) -> list[collapse_lib.Stack]:
  """The lines of the listing: `--collapse`'s stacks, or every leaf as a stack of one."""
  if report.collapse:
    return collapse_lib.collapse(report.leaves, _signature(report))
  return [collapse_lib.Stack(leaf.dotted, (leaf,)) for leaf in report.leaves]


def stack_line(report: ParamReport, stack: collapse_lib.Stack, check_dtype: bool) -> str:
  leaf, placement = stack.first, _placement(report, stack.first)
  if stack.count == 1:
    return leaf_line(leaf, check_dtype, placement)
  line = f"key: {stack.key} | count: {stack.count} | shape each: {_shape(leaf.shape)}"
  line = f"{line} | dtype: {leaf.dtype}" if check_dtype else line
  line = f"{line} | spec: {placement.spec_text()} | shard each: {_shape(placement.shard_shape)}" if placement else line
  return f"{line} | total: {summary_lib.human(stack.size, ' ')}"


def listing_lines(report: ParamReport, check_dtype: bool) -> list[str]:
  """The key lines; with several items (`--all`), each item starts with a `# item:` comment line."""
  lines: list[str] = []
  previous_item = None
  for stack in stacks(report):
    item = stack.first.item
    if report.grouped and item != previous_item:
      count = sum(1 for other in report.leaves if other.item == item)
      lines.append(f"# item: {item} ({count} arrays)")
    previous_item = item
    lines.append(stack_line(report, stack, check_dtype))
  return lines


def _fp8_note(s: summary_lib.Summary) -> str:
  if s.fp8_basis is None:
    return ("fp8: unknown here (no Qwix rules to size it by: a float checkpoint listed without its model, whose "
            "`maxtext <keys> --summary` sizes it, or a config the rules cannot export)")
  return f"fp8: {s.fp8_basis}"


def summary_lines(s: summary_lib.Summary, key_filter: select.KeyFilter | None = None) -> list[str]:
  h, hb = summary_lib.human, summary_lib.human_bytes
  fp8 = lambda n: hb(n) if n is not None else "-"  # pylint: disable=unnecessary-lambda-assignment
  with_scales = s.total_scales > 0
  rows = [("group", "params", "share", "stored", "bf16", "fp8") + (("scales",) if with_scales else ())]
  for r in s.rows:
    name = f"  {r.part}" if r.part else r.group
    share = f"{100 * r.params / s.total_params:.1f}%" if s.total_params else "-"
    rows.append((name, h(r.params), share, hb(r.bytes), hb(r.bytes_bf16), fp8(r.bytes_fp8))
                + ((h(r.scales),) if with_scales else ()))
  rows.append(("total", h(s.total_params), "100.0%", hb(s.total_bytes), hb(2 * s.total_params),
               fp8(s.total_bytes_fp8)) + ((h(s.total_scales),) if with_scales else ()))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  out = ["", "Summary by group" + (f" ({key_filter.describe()})" if key_filter else "") + ":"]
  for row in rows:
    out.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
  out.append(_fp8_note(s))
  if s.active_params is not None:
    out.append(f"Active parameters per token: {s.active_params} (~{h(s.active_params)}), "
               f"with MTP: {s.active_params_with_mtp} (~{h(s.active_params_with_mtp)}) "
               f"[routed experts counted at {s.routed_fraction:.4g} of their size]")
  return out


def chip_lines(report: ParamReport) -> list[str]:
  """The config's quantization at a glance on the `--chip` (or `--topology`) chip, or only the advice without one."""
  if report.chip is None:
    return []
  if not report.glance:
    return [""] + glance_format.advice_text(report.chip)
  return [""] + glance_format.glance_text(report.glance, report.chip)


def format_text(report: ParamReport, *, check_dtype: bool = False, with_summary: bool = False) -> str:
  """MaxText's stdout: key lines, `Total Parameters: N (~X.XX B)`, our totals; optionally the group summary."""
  lines = listing_lines(report, check_dtype)
  lines.extend(total_lines(report))
  if with_summary:
    lines.extend(summary_lines(report.summary, report.key_filter))
    lines.extend(chip_lines(report))
    if report.memory is not None:
      lines.extend(sharding_format.memory_lines(report.memory, report.sharding))
  if report.xla is not None:
    lines.extend(report.xla.text_lines())
  return "\n".join(lines) + "\n"


def format_output_file(report: ParamReport, command: str, *, check_dtype: bool) -> str:
  """MaxText's `--output_file` content: a `# <command>` header, a blank line, the key lines."""
  plain = dataclasses.replace(report, collapse=False)  # MaxText's lines, one per array (a filter still applies)
  return "\n".join([f"# {command}", "", *listing_lines(plain, check_dtype)]) + "\n"


def to_dict(report: ParamReport) -> dict:
  return {
      "schema_version": SCHEMA_VERSION,
      "source": report.source,
      "notes": list(report.notes),
      "parameters": [_stack_dict(report, stack) for stack in stacks(report)],
      "total_parameters": report.summary.total_params,
      "total_scales": report.summary.total_scales,
      "filter": report.key_filter.to_dict() if report.key_filter is not None else None,
      "collapsed": report.collapse,
      "summary": report.summary.to_dict(),
      **({"config": report.config} if report.config is not None else {}),
      **({"sharding": report.sharding.to_dict()} if report.sharding is not None else {}),
      **({"device_memory": report.memory.to_dict()} if report.memory is not None else {}),
      **({"xla": report.xla.to_dict()} if report.xla is not None else {}),
      **({"chip": report.chip.to_dict(), "glance": [v.to_dict() for v in report.glance]}
         if report.chip is not None else {}),
  }


def _stack_dict(report: ParamReport, stack: collapse_lib.Stack) -> dict:
  """One array, or with `--collapse` one stack: `count` arrays of `shape` each, `size` their total."""
  leaf = stack.first
  out = {"key": stack.key, "item": leaf.item, "shape": list(leaf.shape), "dtype": leaf.dtype, "size": stack.size,
         **_placement_dict(_placement(report, leaf))}
  return {**out, "count": stack.count} if report.collapse else out


def _placement_dict(placement) -> dict:
  if placement is None:
    return {}
  return {"spec": placement.spec_per_dim(), "shard_shape": list(placement.shard_shape)}


def format_json(report: ParamReport) -> str:
  return json.dumps(to_dict(report), indent=2) + "\n"


def format_markdown(report: ParamReport, *, check_dtype: bool = True) -> str:
  s = report.summary
  h, hb = summary_lib.human, summary_lib.human_bytes
  out = [f"# Parameters of `{report.source}`", ""]
  out += [f"> {note}" for note in report.notes] + ([""] if report.notes else [])
  out += [f"**{totals_text(report)}**", ""]
  if s.active_params is not None:
    out += [f"**Active parameters per token:** {s.active_params} (~{h(s.active_params)}); "
            f"with MTP {s.active_params_with_mtp} (~{h(s.active_params_with_mtp)})", ""]
  fp8 = lambda n: hb(n) if n is not None else "-"  # pylint: disable=unnecessary-lambda-assignment
  out += ["## Summary by group", "", "| group | part | params | scales | stored | bf16 | fp8 |",
          "|---|---|---:|---:|---:|---:|---:|"]
  out += [f"| {r.group} | {r.part or '(all)'} | {r.params} | {r.scales} | {hb(r.bytes)} | {hb(r.bytes_bf16)} | "
          f"{fp8(r.bytes_fp8)} |" for r in s.rows]
  out += ["", _fp8_note(s)]
  if report.memory is not None:
    out += sharding_format.memory_markdown(report.memory, report.sharding)
  if report.xla is not None:
    out += report.xla.markdown_lines()
  if report.chip is not None:
    out += ["", f"**On {report.chip.chip}:** " + report.chip.advice.partition(": ")[2]]
  columns = (["key"] + (["count", "shape each"] if report.collapse else ["shape"]) + (["dtype"] if check_dtype else [])
             + (["spec", "shard"] if report.sharding else []) + (["total"] if report.collapse else []))
  out += ["", "## Arrays", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for stack in stacks(report):
    leaf = stack.first
    cells = [f"`{stack.key}`"] + ([str(stack.count)] if report.collapse else []) + [_shape(leaf.shape)]
    cells += [leaf.dtype] if check_dtype else []
    placement = _placement(report, leaf)
    cells += [f"`{placement.spec_text()}`", _shape(placement.shard_shape)] if placement else []
    cells += [h(stack.size, " ")] if report.collapse else []
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out) + "\n"


FORMATTERS = {"json": format_json, "markdown": format_markdown}
