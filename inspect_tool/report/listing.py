"""The parameter listing report: MaxText's `key: … | shape: … | dtype: …` lines, JSON and Markdown.

One `ParamReport` serves the `maxtext`, `orbax` and `hf` commands; the formatters below never compute
anything the report does not already hold.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.paramtree import tree
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

  @property
  def items(self) -> list[str]:
    seen: list[str] = []
    for leaf in self.leaves:
      if leaf.item not in seen:
        seen.append(leaf.item)
    return seen


def build_report(source: str, leaves, *, include_all: bool, routed_fraction: float | None = None,
                 notes=(), count_all: bool = False, classify=summary_lib.group_of, config=None) -> ParamReport:
  """Sorts and filters leaves (`params.*` only unless `include_all`) and computes the summary.

  The total counts `params.params.*` leaves (MaxText's convention), or every leaf with `count_all` (HF files).
  """
  chosen = [leaf for leaf in leaves if include_all or count_all or leaf.item == "params"]
  ordered = tree.sort_leaves(chosen)
  grouped = include_all and not count_all
  if grouped:  # group by item, params first, keeping natural order inside each item
    items = sorted({leaf.item for leaf in ordered}, key=lambda item: (item != "params", item))
    ordered = [leaf for item in items for leaf in ordered if leaf.item == item]
  summary = summary_lib.summarize(list(leaves), routed_fraction=routed_fraction, all_leaves=count_all,
                                  classify=classify)
  return ParamReport(source, tuple(ordered), summary, tuple(notes), grouped, config)


def _shape(shape) -> str:
  return str(tuple(int(d) for d in shape))


def leaf_line(leaf: tree.Leaf, check_dtype: bool, placement=None) -> str:
  line = f"key: {leaf.dotted} | shape: {_shape(leaf.shape)}"
  line = f"{line} | dtype: {leaf.dtype}" if check_dtype else line
  return f"{line} | spec: {placement.spec_text()} | shard: {_shape(placement.shard_shape)}" if placement else line


def _placement(report: ParamReport, leaf: tree.Leaf):
  return report.sharding.of(leaf) if report.sharding is not None else None


def total_line(total: int) -> str:
  return f"Total Parameters: {total} (~{total / 1e9:.2f} B)"


def listing_lines(report: ParamReport, check_dtype: bool) -> list[str]:
  """The key lines; with several items (`--all`), each item starts with a `# item:` comment line."""
  lines: list[str] = []
  for leaf_index, leaf in enumerate(report.leaves):
    if report.grouped and (leaf_index == 0 or report.leaves[leaf_index - 1].item != leaf.item):
      count = sum(1 for other in report.leaves if other.item == leaf.item)
      lines.append(f"# item: {leaf.item} ({count} arrays)")
    lines.append(leaf_line(leaf, check_dtype, _placement(report, leaf)))
  return lines


def summary_lines(s: summary_lib.Summary) -> list[str]:
  h, hb = summary_lib.human, summary_lib.human_bytes
  rows = [("group", "params", "share", "stored", "bf16", "fp8")]
  for r in s.rows:
    name = f"  {r.part}" if r.part else r.group
    share = f"{100 * r.params / s.total_params:.1f}%" if s.total_params else "-"
    rows.append((name, h(r.params), share, hb(r.bytes), hb(r.bytes_bf16), hb(r.bytes_fp8)))
  rows.append(("total", h(s.total_params), "100.0%", hb(s.total_bytes), hb(2 * s.total_params),
               hb(s.total_params)))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  out = ["", "Summary by group:"]
  for row in rows:
    out.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
  if s.active_params is not None:
    out.append(f"Active parameters per token: {s.active_params} (~{h(s.active_params)}), "
               f"with MTP: {s.active_params_with_mtp} (~{h(s.active_params_with_mtp)}) "
               f"[routed experts counted at {s.routed_fraction:.4g} of their size]")
  return out


def format_text(report: ParamReport, *, check_dtype: bool = False, with_summary: bool = False) -> str:
  """MaxText's stdout: key lines, then `Total Parameters: N (~X.XX B)`; optionally the group summary."""
  lines = listing_lines(report, check_dtype)
  lines.append(total_line(report.summary.total_params))
  if with_summary:
    lines.extend(summary_lines(report.summary))
    if report.memory is not None:
      lines.extend(sharding_format.memory_lines(report.memory, report.sharding))
  return "\n".join(lines) + "\n"


def format_output_file(report: ParamReport, command: str, *, check_dtype: bool) -> str:
  """MaxText's `--output_file` content: a `# <command>` header, a blank line, the key lines."""
  return "\n".join([f"# {command}", "", *listing_lines(report, check_dtype)]) + "\n"


def to_dict(report: ParamReport) -> dict:
  return {
      "schema_version": SCHEMA_VERSION,
      "source": report.source,
      "notes": list(report.notes),
      "parameters": [{"key": leaf.dotted, "item": leaf.item, "shape": list(leaf.shape), "dtype": leaf.dtype,
                      "size": leaf.size, **_placement_dict(_placement(report, leaf))} for leaf in report.leaves],
      "total_parameters": report.summary.total_params,
      "summary": report.summary.to_dict(),
      **({"config": report.config} if report.config is not None else {}),
      **({"sharding": report.sharding.to_dict()} if report.sharding is not None else {}),
      **({"device_memory": report.memory.to_dict()} if report.memory is not None else {}),
  }


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
  out += [f"**Total parameters:** {s.total_params} (~{h(s.total_params)})", ""]
  if s.active_params is not None:
    out += [f"**Active parameters per token:** {s.active_params} (~{h(s.active_params)}); "
            f"with MTP {s.active_params_with_mtp} (~{h(s.active_params_with_mtp)})", ""]
  out += ["## Summary by group", "", "| group | part | params | stored | bf16 | fp8 |", "|---|---|---:|---:|---:|---:|"]
  out += [f"| {r.group} | {r.part or '(all)'} | {r.params} | {hb(r.bytes)} | {hb(r.bytes_bf16)} | {hb(r.bytes_fp8)} |"
          for r in s.rows]
  if report.memory is not None:
    out += sharding_format.memory_markdown(report.memory, report.sharding)
  columns = ["key", "shape"] + (["dtype"] if check_dtype else []) + (["spec", "shard"] if report.sharding else [])
  out += ["", "## Arrays", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for leaf in report.leaves:
    cells = [f"`{leaf.dotted}`", _shape(leaf.shape)] + ([leaf.dtype] if check_dtype else [])
    placement = _placement(report, leaf)
    cells += [f"`{placement.spec_text()}`", _shape(placement.shard_shape)] if placement else []
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out) + "\n"


FORMATTERS = {"json": format_json, "markdown": format_markdown}
