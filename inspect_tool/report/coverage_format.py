"""Text, JSON and Markdown renderings of a `CoverageReport` (and of `explain` results).

JSON (`to_json_data`) is the stable machine format, schema_version 1:
  {"schema_version": 1,
   "rules": [{"index", "module_path", "op_names", "weight_qtype", "act_qtype", "bwd_qtype", "matches"}],
   "ops": [{"module", "op", "op_name", "rule", "weight", "params", "flops_per_token"}],
   "unused_rules": [rule index, ...],
   "shadowed_rules": [{"index", "shadowed_by": [rule index, ...]}],
   "unquantized_weights": [{"weight", "group", "part", "shape", "params", "flops_per_token", "ops", "rules"}],
   "summary": {"provider", "ops", "quantized_ops", "hidden_lowering_ops", "other_params",
               "groups": {name: {...}}, "total": {...},
               "parts": {group: {part: {...}}}, "other_params_by_part": {part: params},
               "glance": [{"name", "weights", "quantized_weights", "types", "reasons"}],
               "chip": {"chip", "advice", "groups": [{"name", "speeds": [{"unit", "rate_vs_bf16", "text"}]}]}}}
`rule` is a rule index or null; qtypes are names such as "float8_e4m3fn" or null. `part`, the two `parts`
keys and `glance` were added within version 1 (empty when the report has none); each group's parts sum to the
group. `glance` is the verdict block (`inspect_tool.report.coverage_verdict`): types as "e4m3 · e4m3 · e5m2".
`chip` (added within version 1; null without `--chip` / `--topology`) is how each quantized group runs on that
chip's matrix units (`inspect_tool.report.chip_fit`): the unit, its rate over bf16's (null: not published).
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from inspect_tool.report import coverage_report
from inspect_tool.report import glance_format
from quant import rules as rules_lib

SCHEMA_VERSION = 1


def human(n: float) -> str:
  """12345678 -> '12.35 M' (K, M, B, T); small numbers as they are."""
  for factor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
    if abs(n) >= factor:
      return f"{n / factor:.2f} {suffix}"
  return f"{n:g}"


def share_text(part: float, whole: float) -> str:
  """`part / whole` as a percentage that never rounds a partial share up to 100% or down to 0%."""
  if not whole:
    return "-"
  text = f"{100 * part / whole:.1f}%"
  if part != whole and text == "100.0%":
    return ">99.9%"
  if part and text == "0.0%":
    return "<0.1%"
  return text


def _group_data(s: coverage_report.GroupSummary) -> dict[str, Any]:
  return {"weights": s.weights, "quantized_weights": s.quantized_weights, "params": s.params,
          "quantized_params": s.quantized_params, "params_share": round(s.params_share, 6),
          "flops_per_token": s.flops_per_token, "quantized_flops_per_token": s.quantized_flops_per_token,
          "flops_share": round(s.flops_share, 6)}


def to_json_data(report: coverage_report.CoverageReport) -> dict[str, Any]:
  """The report as JSON-ready data (schema in the module docstring)."""
  return {
      "schema_version": SCHEMA_VERSION,
      "rules": [{"index": row.index, "module_path": row.rule.module_path, "op_names": list(row.rule.op_names),
                 "weight_qtype": rules_lib.qtype_name(row.rule.weight_qtype),
                 "act_qtype": rules_lib.qtype_name(row.rule.act_qtype),
                 "bwd_qtype": rules_lib.qtype_name(getattr(row.rule, "bwd_qtype", None)),
                 "matches": row.matches} for row in report.rules],
      "ops": [{"module": op.module, "op": op.op, "op_name": op.op_name, "rule": op.rule, "weight": op.weight,
               "params": op.params, "flops_per_token": op.flops_per_token} for op in report.ops],
      "unused_rules": list(report.unused_rules),
      "shadowed_rules": [{"index": s.index, "shadowed_by": list(s.by)} for s in report.shadowed_rules],
      "unquantized_weights": [{"weight": w.weight, "group": w.group, "part": w.part, "shape": list(w.shape or ()),
                               "params": w.params, "flops_per_token": w.flops_per_token, "ops": list(w.ops),
                               "rules": list(w.rules)} for w in report.unquantized_weights],
      "summary": {
          "provider": report.provider,
          "ops": len(report.ops),
          "quantized_ops": sum(report.op_quantized(op) for op in report.ops),
          "hidden_lowering_ops": len(report.hidden_ops),
          "other_params": report.other_params,
          "groups": {s.group: _group_data(s) for s in report.groups},
          "total": _group_data(report.total),
          "parts": {g.group: {p.part: _group_data(p) for p in report.parts if p.group == g.group}
                    for g in report.groups if any(p.group == g.group for p in report.parts)},
          "other_params_by_part": dict(report.other_params_by_part),
          "glance": [v.to_dict() for v in report.glance],
          "chip": report.chip.to_dict() if report.chip is not None else None,
      },
  }


def to_json(report: coverage_report.CoverageReport) -> str:
  return json.dumps(to_json_data(report), indent=2) + "\n"


def _rule_text(rule) -> str:
  ops = ",".join(rule.op_names) if rule.op_names else "*"
  qtypes = "/".join(str(rules_lib.qtype_name(q)) for q in (rule.weight_qtype, rule.act_qtype,
                                                            getattr(rule, "bwd_qtype", None)))
  return f"{rule.module_path}  ops={ops}  w/a/bwd={qtypes}"


def _rule_label(index: int | None) -> str:
  return "-" if index is None else str(index)


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
                           ).rstrip() for r in rows]


def to_text(report: coverage_report.CoverageReport, *, show_einsum: bool = True) -> str:
  """A plain-text report for terminals."""
  lines = [f"Qwix rule coverage ({len(report.rules)} rules, provider {report.provider or 'none'}; first match wins)"]
  if report.glance:
    lines += [""] + glance_format.glance_text(report.glance, report.chip)
  lines.append("")
  lines.append("Rules:")
  if not report.rules:
    lines.append("  (none: quantization is off)")
  for row in report.rules:
    lines.append(f"  [{row.index}] {_rule_text(row.rule)}  matches={row.matches}")
  ops = [op for op in report.ops if show_einsum or op.matmul or op.rule is not None]
  quantized = sum(report.op_quantized(op) for op in report.ops)
  lines += ["", f"Ops ({len(report.ops)} intercepted, {quantized} quantized; FLOPs = 2 x weight params used per "
            "token):"]
  rows = [("module", "op", "rule", "q", "params", "FLOPs/token")]
  for op in ops:
    rows.append((op.module, coverage_report.op_label(op), _rule_label(op.rule), "Q" if report.op_quantized(op) else "",
                 human(op.params) if op.weight else "", human(op.flops_per_token) if op.flops_per_token else ""))
  lines += _table(rows, right=(4, 5))
  if report.hidden_ops:
    lines.append(f"  ({len(report.hidden_ops)} dot_general op(s) issued by JAX's own ragged_dot implementation "
                 "left out: " + ", ".join(f"{op.module}:{op.op}" for op in report.hidden_ops) + ")")
  lines += ["", "Unused rules: " + (", ".join(map(str, report.unused_rules)) or "none")]
  lines.append("Shadowed rules: " + (", ".join(f"{s.index} (by {', '.join(map(str, s.by))})"
                                              for s in report.shadowed_rules) or "none"))
  unq = report.unquantized_weights
  lines += ["", f"Unquantized matmul weights ({len(unq)}):"]
  if unq:
    rows = [("group", "part", "weight", "params", "FLOPs/token", "rule")]
    rows += [(w.group, w.part or "-", w.weight, human(w.params), human(w.flops_per_token),
              ",".join(_rule_label(r) for r in w.rules)) for w in unq]
    lines += _table(rows, right=(3, 4))
  else:
    lines.append("  none")
  lines += ["", "Quantized share of matmul weights:"]
  rows = [("group / part", "weights", "params", "share", "FLOPs/token", "share")]
  for s in _summary_rows(report):
    rows.append(("  " + s.part if s.part else s.group, f"{s.quantized_weights}/{s.weights}",
                 f"{human(s.quantized_params)}/{human(s.params)}", share_text(s.quantized_params, s.params),
                 f"{human(s.quantized_flops_per_token)}/{human(s.flops_per_token)}",
                 share_text(s.quantized_flops_per_token, s.flops_per_token)))
  lines += _table(rows, right=(1, 2, 3, 4, 5))
  lines.append(f"  (other params, not consumed by any matmul: {human(report.other_params)})")
  if report.other_params_by_part:
    lines.append("  (of which " + ", ".join(f"{part or '-'} {human(n)}" for part, n in report.other_params_by_part)
                 + ")")
  return "\n".join(lines) + "\n"


def _summary_rows(report: coverage_report.CoverageReport) -> list[coverage_report.GroupSummary]:
  """Each group followed by its parts, then the total."""
  rows = []
  for group in report.groups:
    rows += [group] + [p for p in report.parts if p.group == group.group]
  return rows + [report.total]


# Characters that could start emphasis, code, links, HTML or entities, or end a cell; `_` between two letters or
# digits never delimits emphasis, so `dot_general` stays as typed.
_MD_ACTIVE = re.compile(r"([\\`*\[\]<>|~&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def md_cell(text: str) -> str:
  """Plain text for a Markdown table cell: line breaks as spaces, `|` and the characters that would start
  emphasis, code, links, HTML or entities backslash-escaped (`decoder/.*layers.*` reads back as typed)."""
  return _MD_ACTIVE.sub(r"\\\1", " ".join(str(text).split()))


def md_code(text: str) -> str:
  """A code span for a table cell; only `|` is escaped (GFM removes that escape inside a table's code spans)."""
  text = " ".join(str(text).split())
  fence = "``" if "`" in text else "`"
  pad = " " if text.startswith("`") or text.endswith("`") else ""
  escaped = text.replace("|", "\\|")
  return f"{fence}{pad}{escaped}{pad}{fence}"


def _md_row(cells: Sequence[str]) -> str:
  return "| " + " | ".join(cells) + " |"


def to_markdown(report: coverage_report.CoverageReport) -> str:
  """A Markdown report (tables) for pull requests and docs; every cell escaped (`md_cell`, `md_code`)."""
  out = ["# Qwix rule coverage", "", f"Provider `{report.provider or 'none'}`; first matching rule wins.", ""]
  if report.glance:
    chip = report.chip
    out += ["## At a glance", "", "Matmul weights quantized / all; types: weights · activations · gradients.", "",
            "| group | quantized | types | not quantized because |" + (f" on {md_cell(chip.chip)} |" if chip else ""),
            "|---|---:|---|---|" + ("---|" if chip else "")]
    for v in report.glance:
      out.append(_md_row([md_cell(v.name), v.count, md_cell(" / ".join(v.types) if v.quantized else ""),
                          md_cell("; ".join(v.reasons))]
                         + ([md_cell(chip.text_of(v.name).partition(": ")[2])] if chip else [])))
    out += ["", md_cell(chip.advice), ""] if chip else [""]
  out += ["## Rules", "", "| # | module_path | op_names | weight | act | bwd | matches |", "|---|---|---|---|---|---|---|"]
  for row in report.rules:
    r = row.rule
    out.append(_md_row([str(row.index), md_code(r.module_path), md_cell(", ".join(r.op_names) or "*"),
                        md_cell(rules_lib.qtype_name(r.weight_qtype)), md_cell(rules_lib.qtype_name(r.act_qtype)),
                        md_cell(rules_lib.qtype_name(getattr(r, "bwd_qtype", None))), str(row.matches)]))
  out += ["", "## Ops", "", "| module | op | rule | quantized | weight params | FLOPs/token |",
          "|---|---|---|---|---:|---:|"]
  for op in report.ops:
    out.append(_md_row([md_code(op.module), md_cell(coverage_report.op_label(op)), _rule_label(op.rule),
                        "yes" if report.op_quantized(op) else "", human(op.params) if op.weight else "",
                        human(op.flops_per_token) if op.flops_per_token else ""]))
  out += ["", "## Findings", "",
          f"* Unused rules: {', '.join(map(str, report.unused_rules)) or 'none'}",
          "* Shadowed rules: " + (", ".join(f"{s.index} (by {', '.join(map(str, s.by))})"
                                           for s in report.shadowed_rules) or "none"),
          f"* Unquantized matmul weights: {len(report.unquantized_weights)}"]
  for w in report.unquantized_weights:
    out.append(f"  * `{w.weight}` ({w.group}{', ' + w.part if w.part else ''}, {human(w.params)} params)")
  out += ["", "## Summary", "", "| group / part | weights | params quantized | share | FLOPs/token quantized | share |",
          "|---|---:|---:|---:|---:|---:|"]
  for s in _summary_rows(report):
    name = f"&nbsp;&nbsp;{md_cell(s.part)}" if s.part else md_cell(s.group)
    out.append(_md_row([name, f"{s.quantized_weights}/{s.weights}", f"{human(s.quantized_params)}/{human(s.params)}",
                        share_text(s.quantized_params, s.params),
                        f"{human(s.quantized_flops_per_token)}/{human(s.flops_per_token)}",
                        share_text(s.quantized_flops_per_token, s.flops_per_token)]))
  return "\n".join(out) + "\n"


def explain_text(explanations: Sequence[coverage_report.Explanation]) -> str:
  """Each rule tried, in order, with the regex and op-filter outcome."""
  lines = []
  for ex in explanations:
    head = f"{ex.module_path}" + (f" (op {ex.op_name})" if ex.op_name else "")
    lines.append(f"{head}: " + (f"rule {ex.winner} wins" if ex.winner is not None else "no rule matches"))
    if ex.ops:
      lines.append("  recorded ops: " + ", ".join(f"{op.op} -> rule {_rule_label(op.rule)}" for op in ex.ops))
    elif ex.traced is False:
      hint = f"; did you mean {' or '.join(ex.suggestions)}?" if ex.suggestions else ""
      lines.append(f"  (no op of this module was traced{hint})")
    for v in ex.verdicts:
      regex = f"fullmatch({v.rule.module_path!r}) {'yes' if v.path_matches else 'no'}"
      names = ", ".join(v.rule.op_names)
      if not v.rule.op_names:
        ops = "op_names: any op"
      elif v.op_matches is None:
        ops = f"op_names [{names}] (op not given)"
      else:
        ops = f"op {ex.op_name!r} {'in' if v.op_matches else 'not in'} [{names}]"
      if v.wins:
        verdict = "WINS" if v.rule.weight_qtype is not None else "WINS (no weight_qtype: the op stays unquantized)"
      elif v.shadowed_by is not None:
        verdict = f"matches, but rule {v.shadowed_by} came first"
      else:
        verdict = "no match"
      lines.append(f"  [{v.index}] {regex}; {ops} -> {verdict}")
    if not ex.verdicts:
      lines.append("  (no rules)")
  return "\n".join(lines) + "\n"
