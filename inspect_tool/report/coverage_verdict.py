"""Coverage at a glance: per group of matmul weights, how many are quantized, with which types, or why not.

`build(report, label_of)` folds a `CoverageReport`'s matmul weights into named groups (the caller's `label_of`
maps a weight row to a group name, or None to leave it out) and answers for each: quantized weights over all
(exact counts), the qtypes of the rules that quantize them (weights · activations · gradients, e.g.
`e4m3 · e4m3 · e5m2`) and, for the others, why no rule quantizes them:
  * "no rule matches": no rule's module_path matches the op's module;
  * "gmm: rule 0 names only dot_general": a rule's path matches but its op_names leave the op out;
  * "rule 1 has no weight type": the winning rule quantizes nothing (MaxText's router rule);
  * "no rules (quantization is off)": the rule list is empty.
A caller may reword a reason (`reword(name, reason)`, e.g. "no rule matches" → "quantize_mtp=false").
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

from inspect_tool.report import coverage_report
from quant import rules as rules_lib

NO_RULES = "no rules (quantization is off)"
NO_MATCH = "no rule matches"
SEPARATOR = " · "


@dataclasses.dataclass(frozen=True)
class Reason:
  """Why one weight stays unquantized: `kind` is 'no_rules', 'no_match', 'op_names' or 'no_weight_qtype'."""

  kind: str
  text: str
  rule: int | None = None


@dataclasses.dataclass(frozen=True)
class Verdict:
  """One group of matmul weights: `quantized` of `weights` quantized, the types used, why the rest are not."""

  name: str
  weights: int
  quantized: int
  types: tuple[str, ...] = ()  # "e4m3 · e4m3 · e5m2" per distinct (weight, act, bwd) qtypes in use
  reasons: tuple[str, ...] = ()  # distinct reasons of the unquantized weights (or why the group is empty)
  qtypes: tuple[tuple[str | None, str | None], ...] = ()  # the (weight, activation) qtype names of `types`

  @property
  def count(self) -> str:
    return f"{self.quantized}/{self.weights}" if self.weights else "-"

  @property
  def status(self) -> str:
    """"e4m3 · e4m3 · e5m2", "not quantized: <reason>", or both for a partly quantized group."""
    why = "; ".join(self.reasons)
    types = " / ".join(self.types)
    if not self.weights:
      return why or "no matmul weights"
    if self.quantized == self.weights:
      return types
    if not self.quantized:
      return f"not quantized: {why}"
    return f"{types}; {self.weights - self.quantized} not quantized: {why}"

  def to_dict(self) -> dict:
    return {"name": self.name, "weights": self.weights, "quantized_weights": self.quantized,
            "types": list(self.types), "reasons": list(self.reasons)}


def short_qtype(qtype) -> str:
  """`e4m3` for float8_e4m3fn, `e5m2`, `e2m1` for float4_e2m1fn, `int8`, ...; `none` for no quantization."""
  name = rules_lib.qtype_name(qtype)
  if name is None:
    return "none"
  match = re.fullmatch(r"float\d+_(e\dm\d)(fn)?", name)
  return match.group(1) if match else name


def types_text(rule) -> str:
  """A rule's weight · activation · gradient qtypes, e.g. `e4m3 · e4m3 · e5m2`."""
  return SEPARATOR.join(short_qtype(q) for q in (rule.weight_qtype, rule.act_qtype, getattr(rule, "bwd_qtype", None)))


def op_reason(report: coverage_report.CoverageReport, op) -> Reason:
  """Why `op` (a recorded op of `report`) does not run quantized."""
  if not report.rules:
    return Reason("no_rules", NO_RULES)
  if op.rule is not None:
    return Reason("no_weight_qtype", f"rule {op.rule} has no weight type", op.rule)
  for row in report.rules:
    if re.fullmatch(row.rule.module_path, op.module) and row.rule.op_names and op.op_name not in row.rule.op_names:
      return Reason("op_names", f"{op.op_name}: rule {row.index} names only {', '.join(row.rule.op_names)}",
                    row.index)
  return Reason("no_match", NO_MATCH)


def build(report: coverage_report.CoverageReport, label_of: Callable[[coverage_report.WeightRow], str | None],
          order: Sequence[str] = (), reword: Callable[[str, Reason], str] | None = None) -> tuple[Verdict, ...]:
  """One `Verdict` per group name `label_of` gives (names in `order` first, the others as they appear)."""
  ops_of: dict[str, list] = {}
  for op in report.ops:
    if op.matmul and op.weight is not None:
      ops_of.setdefault(op.weight, []).append(op)
  members: dict[str, list[coverage_report.WeightRow]] = {}
  for weight in report.weights:
    name = label_of(weight)
    if name is not None:
      members.setdefault(name, []).append(weight)
  rank = {name: i for i, name in enumerate(order)}
  out = []
  for name in sorted(members, key=lambda n: (rank.get(n, len(rank)), list(members).index(n))):
    types, qtypes, reasons = [], [], []
    for weight in members[name]:
      ops = ops_of.get(weight.weight, [])
      if weight.quantized:
        rules = [report.rules[op.rule].rule for op in ops if report.op_quantized(op)]
        types += [types_text(rule) for rule in rules]
        qtypes += [(rules_lib.qtype_name(r.weight_qtype), rules_lib.qtype_name(r.act_qtype)) for r in rules]
      elif ops:
        reason = op_reason(report, ops[0])
        reasons.append(reword(name, reason) if reword else reason.text)
    out.append(Verdict(name=name, weights=len(members[name]), quantized=sum(w.quantized for w in members[name]),
                       types=tuple(dict.fromkeys(types)), reasons=tuple(dict.fromkeys(reasons)),
                       qtypes=tuple(dict.fromkeys(qtypes))))
  return tuple(out)
