"""The rule coverage report: built once from a `coverage.Trace`, read by every formatter.

It answers: which rule won how many ops, which rules never win (unused) or are hidden behind earlier rules
(shadowed), which matmul weights no quantized op reaches, and what share of matmul parameters and of weight
FLOPs per token is quantized per group of modules, and per part of each group. Groups come from a small table of
module-path prefixes that the caller passes (first prefix that a module path starts with wins; otherwise
`default_group`); parts from a callable the caller passes too (weight path -> part name, e.g. "moe stack: indexer"),
so this module stays model-agnostic.

A weight counts as quantized when at least one op consuming it runs quantized (`rules.quantizes`: a matched
rule with a weight qtype under Qwix's QtProvider). Parameters count once per weight; FLOPs count per op (a
weight used by two ops, like an output head shared by the MTP block, contributes its FLOPs twice).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Callable, Sequence

import qwix

from quant import coverage, rules as rules_lib

GroupTable = Sequence[tuple[str, str]]  # (module-path prefix, group name), first match wins
PartOf = Callable[[str], str]  # '/'-joined weight path -> the name of its part ("" for none)


@dataclasses.dataclass(frozen=True)
class RuleRow:
  index: int
  rule: qwix.QtRule
  matches: int  # Qwix's match counter: ops and rule lookups that this rule won
  ops: int  # distinct reported ops (module, op id) this rule won


@dataclasses.dataclass(frozen=True)
class Shadowed:
  index: int  # the rule that never wins
  by: tuple[int, ...]  # the earlier rules that win every op it would match


@dataclasses.dataclass(frozen=True)
class WeightRow:
  """A weight consumed by at least one matmul op."""

  weight: str
  group: str
  shape: tuple[int, ...]
  params: int
  flops_per_token: int  # summed over the ops that consume it
  quantized: bool
  ops: tuple[str, ...]  # "module:op" of each consuming op
  rules: tuple[int | None, ...]  # winning rule of each consuming op
  part: str = ""  # the part of its group (see `build_report`'s `part_of`)


@dataclasses.dataclass(frozen=True)
class GroupSummary:
  group: str
  weights: int
  quantized_weights: int
  params: int
  quantized_params: int
  flops_per_token: int
  quantized_flops_per_token: int
  part: str = ""  # "" for a whole group (or the total)

  @property
  def params_share(self) -> float:
    return self.quantized_params / self.params if self.params else 0.0

  @property
  def flops_share(self) -> float:
    return self.quantized_flops_per_token / self.flops_per_token if self.flops_per_token else 0.0


@dataclasses.dataclass(frozen=True)
class RuleVerdict:
  """Why one rule did or did not match a module path (and op name)."""

  index: int
  rule: qwix.QtRule
  path_matches: bool  # re.fullmatch(rule.module_path, module_path)
  op_matches: bool | None  # op name passes rule.op_names (None: no op name given and the rule filters ops)
  wins: bool  # first rule that matches
  shadowed_by: int | None  # an earlier rule that already matched


@dataclasses.dataclass(frozen=True)
class Explanation:
  module_path: str
  op_name: str | None
  verdicts: tuple[RuleVerdict, ...]
  ops: tuple[coverage.OpRecord, ...]  # the recorded ops of this module with this op name (report only)
  traced: bool | None = None  # with a report: whether the module had any recorded op; None for plain rules
  suggestions: tuple[str, ...] = ()  # with a report and an unknown module: the closest traced module paths

  @property
  def winner(self) -> int | None:
    return next((v.index for v in self.verdicts if v.wins), None)


@dataclasses.dataclass(frozen=True)
class CoverageReport:
  """Everything the formatters show; built by `build_report`."""

  rules: tuple[RuleRow, ...]
  ops: tuple[coverage.OpRecord, ...]  # reported ops (JAX lowering artifacts left out)
  unused_rules: tuple[int, ...]
  shadowed_rules: tuple[Shadowed, ...]
  weights: tuple[WeightRow, ...]  # matmul weights, in first-use order
  groups: tuple[GroupSummary, ...]  # default group first, then the table's groups in table order
  total: GroupSummary
  other_params: int  # params of the model that no matmul op consumes (embeddings, norms, biases, ...)
  hidden_ops: tuple[coverage.OpRecord, ...]  # lowering artifacts that were left out of `ops`
  provider: str | None
  group_table: tuple[tuple[str, str], ...]
  default_group: str
  parts: tuple[GroupSummary, ...] = ()  # per (group, part), groups in `groups` order; they sum to their group
  other_params_by_part: tuple[tuple[str, int], ...] = ()  # `other_params` split by part (with `part_of` only)
  glance: tuple = ()  # `inspect_tool.report.coverage_verdict.Verdict`s, the report at a glance (set by the caller)
  chip: Any = None  # `inspect_tool.report.chip_fit.ChipFit`: the glance on one chip (`rules --chip`), or None

  @property
  def unquantized_weights(self) -> tuple[WeightRow, ...]:
    return tuple(w for w in self.weights if not w.quantized)

  def op_quantized(self, op: coverage.OpRecord) -> bool:
    rule = self.rules[op.rule].rule if op.rule is not None else None
    return rules_lib.quantizes(rule, op.op_name, self.provider)

  def group_of(self, module_path: str) -> str:
    return group_of(module_path, self.group_table, self.default_group)

  def module_rules(self) -> dict[str, int | None]:
    """Module path -> the rule that won its weight-consuming ops (else any of its ops), None if none won."""
    out: dict[str, int | None] = {}
    for op in self.ops:
      out.setdefault(op.module, None)
    for prefer_matmul in (True, False):
      for op in self.ops:
        if out[op.module] is None and op.rule is not None and (op.matmul or not prefer_matmul):
          out[op.module] = op.rule
    return out

  def strict_findings(self, required_groups: Sequence[str] = ("decoder",)) -> list[str]:
    """`--strict` problems: unused rules, and matmul weights of `required_groups` that stay unquantized."""
    findings = []
    for index in self.unused_rules:
      rule = self.rules[index].rule
      shadow = next((s for s in self.shadowed_rules if s.index == index), None)
      why = (f"shadowed by rule {', '.join(map(str, shadow.by))}" if shadow else "matches no op")
      findings.append(f"rule {index} (module_path {rule.module_path!r}, op_names {list(rule.op_names)}) is unused: "
                      f"{why}")
    for weight in self.unquantized_weights:
      if weight.group in required_groups:
        part = f"{weight.part}, " if weight.part else ""
        ops = [f"{op.module}:{op_label(op)}" for op in self.ops if op.matmul and op.weight == weight.weight]
        findings.append(f"{weight.group} weight {weight.weight} ({part}{weight.params:,} params) is not quantized "
                        f"(ops {', '.join(ops)})")
    return findings


def strict_verdict(report: CoverageReport, findings: Sequence[str], required_groups: Sequence[str] = ("decoder",)
                   ) -> str:
  """`--strict`'s one-line verdict, passed or FAILED, with what it required (`findings`: `strict_findings`)."""
  required = [g for g in report.groups if g.group in required_groups]
  others = [g.group for g in report.groups if g.group not in required_groups and g.weights]
  weights, quantized = sum(g.weights for g in required), sum(g.quantized_weights for g in required)
  scope = f"{'/'.join(required_groups)} matmul weights"
  not_required = f" (not required: {', '.join(others)})" if others else ""
  unused = len(report.unused_rules)
  if findings:
    return (f"strict: FAILED: {quantized}/{weights} {scope} quantized, {unused} unused rule(s){not_required}; "
            "exit 1")
  return f"strict: passed: {quantized}/{weights} {scope} quantized, every rule used{not_required}"


def op_label(op: coverage.OpRecord) -> str:
  """How the text reports name an op: Qwix's id (`dot_general0`); a grouped matmul by the expert weight it
  consumes (`gmm(wi_0)`, not the lookup id `gmm0`)."""
  if op.op_name in coverage.GROUPED_OPS and op.weight:
    return f"{op.op_name}({op.weight.rsplit('/', 1)[-1]})"
  return op.op


def group_of(module_path: str, table: GroupTable, default: str) -> str:
  return next((group for prefix, group in table if module_path.startswith(prefix)), default)


def build_report(trace: coverage.Trace, group_table: GroupTable = (), default_group: str = "model",
                 part_of: PartOf | None = None, part_order: Sequence[str] = ()) -> CoverageReport:
  """Derives the whole report from a trace; `group_table` classifies module paths by prefix.

  `part_of` splits each group by weight path (parts listed in `part_order` first, in that order, then the
  others as they first appear); without it there are no parts.
  """
  table = tuple((str(p), str(g)) for p, g in group_table)
  part_cache: dict[str, str] = {}

  def part(path: str) -> str:
    if path not in part_cache:
      part_cache[path] = str(part_of(path)) if part_of is not None else ""
    return part_cache[path]
  ops = trace.visible_ops()
  hidden = tuple(op for op in trace.ops if op.lowering)
  rule_rows = tuple(RuleRow(index=i, rule=r, matches=trace.rule_matches[i], ops=sum(op.rule == i for op in ops))
                    for i, r in enumerate(trace.rules))
  unused = tuple(i for i, m in enumerate(trace.rule_matches) if m == 0)
  shadowed = []
  for index in unused:
    rule = trace.rules[index]
    winners = {op.rule for op in trace.ops
               if re.fullmatch(rule.module_path, op.module) and (not rule.op_names or op.op_name in rule.op_names)}
    if winners:
      shadowed.append(Shadowed(index=index, by=tuple(sorted(w for w in winners if w is not None))))

  def quantized(op: coverage.OpRecord) -> bool:
    rule = trace.rules[op.rule] if op.rule is not None else None
    return rules_lib.quantizes(rule, op.op_name, trace.provider)

  by_weight: dict[str, list[coverage.OpRecord]] = {}
  for op in ops:
    if op.matmul and op.weight is not None:
      by_weight.setdefault(op.weight, []).append(op)
  weights = tuple(
      WeightRow(weight=name, group=group_of(uses[0].module, table, default_group), shape=uses[0].weight_shape,
                params=uses[0].params, flops_per_token=sum(op.flops_per_token for op in uses),
                quantized=any(quantized(op) for op in uses), ops=tuple(f"{op.module}:{op.op}" for op in uses),
                rules=tuple(op.rule for op in uses), part=part(name))
      for name, uses in by_weight.items())

  names = [default_group] + [g for _, g in table]
  group_names = list(dict.fromkeys(names))
  matmuls = [(op, group_of(op.module, table, default_group), part(op.weight)) for op in ops
             if op.matmul and op.weight is not None]

  def summarize(group: str | None, part_name: str | None = None) -> GroupSummary:
    """One group (None: all), or one part of it."""
    in_group = [w for w in weights if group in (None, w.group) and part_name in (None, w.part)]
    group_ops = [op for op, g, p in matmuls if group in (None, g) and part_name in (None, p)]
    return GroupSummary(
        group=group or "total", part=part_name or "", weights=len(in_group),
        quantized_weights=sum(w.quantized for w in in_group), params=sum(w.params for w in in_group),
        quantized_params=sum(w.params for w in in_group if w.quantized),
        flops_per_token=sum(op.flops_per_token for op in group_ops),
        quantized_flops_per_token=sum(op.flops_per_token for op in group_ops if quantized(op)))

  groups = tuple(s for s in map(summarize, group_names) if s.weights or s.group != default_group)
  parts = []
  if part_of is not None:
    for s in groups:
      found = list(dict.fromkeys([w.part for w in weights if w.group == s.group]
                                 + [p for _, g, p in matmuls if g == s.group]))
      parts += [summarize(s.group, p) for p in _ordered(found, part_order)]
  others: dict[str, int] = {}
  for path, shape in trace.param_shapes.items():
    if path not in by_weight:
      others[part(path)] = others.get(part(path), 0) + _prod(shape)
  return CoverageReport(rules=rule_rows, ops=ops, unused_rules=unused, shadowed_rules=tuple(shadowed),
                        weights=weights, groups=groups, total=summarize(None), other_params=sum(others.values()),
                        hidden_ops=hidden, provider=trace.provider, group_table=table, default_group=default_group,
                        parts=tuple(parts), other_params_by_part=(
                            tuple((p, others[p]) for p in _ordered(list(others), part_order)) if part_of else ()))


def _ordered(names: Sequence[str], order: Sequence[str]) -> list[str]:
  """`names` in `order`'s order, those not in it after, as given."""
  rank = {name: i for i, name in enumerate(order)}
  return sorted(names, key=lambda n: (rank.get(n, len(rank)), names.index(n)))


def explain(report_or_rules: CoverageReport | Sequence[qwix.QtRule], module_path: str,
            op_name: str | None = None) -> list[Explanation]:
  """Each rule tried on `module_path`, in order, and why it matched or not.

  Without `op_name`: with a report, one explanation per op name recorded for that module; with plain
  rules, one per op name that a rule matching the path lists (or a single one with the op left open,
  `op_matches` None, when no such rule lists op names).
  """
  traced, suggestions = None, ()
  if isinstance(report_or_rules, CoverageReport):
    rule_list = [row.rule for row in report_or_rules.rules]
    recorded = [op for op in report_or_rules.ops if op.module == module_path]
    traced = bool(recorded)
    if not traced:
      modules = list(dict.fromkeys(op.module for op in report_or_rules.ops))
      suggestions = tuple(difflib.get_close_matches(module_path, modules, n=3, cutoff=0.6))
  else:
    rule_list, recorded = list(report_or_rules), []
  if op_name:
    op_names = [op_name]
  elif recorded:
    op_names = list(dict.fromkeys(op.op_name for op in recorded))
  else:  # every op name a rule whose path matches would accept (None: "any op" rules only, or none)
    matching = [r for r in rule_list if re.fullmatch(r.module_path, module_path)]
    op_names = list(dict.fromkeys(n for r in matching for n in r.op_names)) or [None]
  out = []
  for name in op_names:
    verdicts, first = [], None
    for index, rule in enumerate(rule_list):
      path_ok = re.fullmatch(rule.module_path, module_path) is not None
      op_ok = True if not rule.op_names else (None if name is None else name in rule.op_names)
      matches = path_ok and op_ok is True
      verdicts.append(RuleVerdict(index=index, rule=rule, path_matches=path_ok, op_matches=op_ok,
                                  wins=matches and first is None, shadowed_by=first if matches else None))
      if matches and first is None:
        first = index
    out.append(Explanation(module_path=module_path, op_name=name, verdicts=tuple(verdicts),
                           ops=tuple(op for op in recorded if op.op_name == name), traced=traced,
                           suggestions=suggestions))
  return out


def _prod(shape: Sequence[int]) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n
