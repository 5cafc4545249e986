"""The DeepSeek side of `inspect_checkpoint rules`: Qwix rule coverage of the model a config describes.

`trace_coverage(cfg)` builds MaxText's rules from the config (or takes user rules / a rule file), builds the
abstract model, and traces one forward pass the way MaxText's `maybe_quantize_model` does (dummy inputs of
ones; `decoder_target_tokens`/`decoder_target_mask` when MTP is on so that the MTP block is traced too),
under `nnx.eval_shape`: nothing is allocated, scanned stacks are traced once.

The batch is (1, min(max_target_length, 16)): which ops run and which rule each gets does not depend on the
shape, and FLOPs per token are computed from the weights (see `quant.coverage`), so a short sequence only
makes the trace cheaper.

Module groups for the summary: `mtp_block/...` → mtp, `decoder/logits_dense` and V4's hyper head
`decoder/hc_head` → head (the logits head's both calls: the main head `dot_general0` and the MTP head
`dot_general1`), everything else → decoder. Each group is split into the parts `--summary` names
(`summary.classify_path`: "moe stack: indexer", "dense stack: mHC mixing", ...), so `--strict`'s required
group stays "decoder" — the layers MaxText's rules are written for.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from inspect_tool import model as model_lib
from inspect_tool.configuration import validation
from inspect_tool.coverage import glance
from inspect_tool.paramtree import summary
from inspect_tool.report import coverage_report
from inspect_tool.report import coverage_verdict
from inspect_tool.report import html
from quant import coverage
from quant import rules as rules_lib

GROUPS = (("mtp_block/", "mtp"), ("decoder/logits_dense", "head"), ("decoder/hc_head", "head"))
DEFAULT_GROUP = "decoder"


def part_of(weight: str) -> str:
  """The coverage part of a weight path: `--summary`'s group and part, e.g. "moe stack: router", "head"."""
  group, part = summary.classify_path(weight)
  return f"{group}: {part}" if part else group


def part_order() -> list[str]:
  """Every part `part_of` can name, in `--summary`'s order."""
  return [f"{group}: {part}" if part else group for group, part in summary.GROUP_PARTS]


def quant_settings(cfg):
  """The config's quantization keys as `quant.rules.QuantSettings`."""
  return rules_lib.QuantSettings.from_object(cfg)


def config_rules(cfg) -> list:
  """MaxText's Qwix rules for the config ([] without quantization)."""
  return rules_lib.build_rules(quant_settings(cfg))


def untraced_mtp(cfg) -> str | None:
  """Why the MTP block is left out of the trace (None: it is traced): MaxText builds it but its forward pass,
  and so its Qwix pass, fails there (`validation.forward_failure`); the trace records what runs before."""
  reason = validation.forward_failure(cfg)
  return f"mtp_block is not traced: {reason}" if reason else None


def trace(cfg, rules: Sequence | str | os.PathLike | None = None):
  """The raw `quant.coverage.Trace` for the config (rules: None → MaxText's, a list, or a YAML rule file)."""
  if rules is None:
    rule_list = config_rules(cfg)
    provider = rules_lib.provider_name(cfg.quantization) or "qt"
  elif isinstance(rules, (str, os.PathLike)):
    rule_list, provider = rules_lib.load_rule_file(rules), "qt"
  else:
    rule_list, provider = list(rules), "qt"
  args, kwargs = model_lib.qwix_init_inputs(cfg)
  model = model_lib.build_model(cfg, abstract=True)
  model.skip_mtp = bool(untraced_mtp(cfg))
  return coverage.trace_model(model, rule_list, *args,
                              experts_per_token=cfg.num_experts_per_tok, provider=provider, **kwargs)


def trace_coverage(cfg, rules: Sequence | str | os.PathLike | None = None):
  """The `report.coverage_report.CoverageReport` for the config, grouped decoder / mtp / head, split by part,
  with its verdicts at a glance (`glance.verdicts`)."""
  report = coverage_report.build_report(trace(cfg, rules), GROUPS, DEFAULT_GROUP, part_of=part_of,
                                        part_order=part_order())
  return dataclasses.replace(report, glance=glance.verdicts(cfg, report, config_rules=rules is None))


def module_labels(report) -> dict[str, str]:
  """Module path → the label the HTML tree shows: the winning rule and its weight qtype, or "unquantized"."""
  labels = {}
  for module, index in report.module_rules().items():
    rule = report.rules[index].rule if index is not None else None
    if rule is None or rule.weight_qtype is None:
      labels[module] = "unquantized" if rule is None else f"rule {index} (unquantized)"
    else:
      labels[module] = f"rule {index} ({rules_lib.qtype_name(rule.weight_qtype)})"
  return labels


RULE_KEYS = ("quantization", "quantize_mtp", "quantize_router_proj", "quantize_logits_proj", "megablox")


def key_set(cfg, overrides: Sequence[str] = ()) -> str:
  """The given keys as typed, then the config's value of every key the rules depend on that was not given."""
  given = [t for t in overrides if "=" in t]
  names = {t.split("=", 1)[0] for t in given}
  tokens = given if "model_name" in names else [f"model_name={cfg.model_name}"] + given
  for key in RULE_KEYS:
    if key not in names:
      value = getattr(cfg, key)
      tokens.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
  return " ".join(tokens)


def coverage_html(cfg, report, overrides: Sequence[str] = ()) -> str:
  """The treescope module tree of the (abstract) model, each module marked by the rule that won its ops (one
  colour per label), under the verdicts at a glance and a legend; the title holds the whole key set."""
  labels = module_labels(report)
  order = sorted(set(labels.values()), key=_label_rank)
  colors = html.distinct_colors(order, neutral=("unquantized",))
  chip = report.chip
  glance = html.Table("At a glance: matmul weights quantized / all" + (f"; {chip.advice}" if chip else ""), (
      "group", "quantized", "types (weights · activations · gradients)", "not quantized because")
      + ((f"on {chip.chip}",) if chip else ()),
      tuple((v.name, v.count, " / ".join(v.types) if v.quantized else "", "; ".join(v.reasons))
            + ((chip.text_of(v.name).partition(": ")[2],) if chip else ()) for v in report.glance))
  counts = {label: sum(1 for v in labels.values() if v == label) for label in order}
  legend = html.Table("Legend: the rule that won each module's ops", ("label", "meaning", "modules"), tuple(
      (label, _label_meaning(report, label, coverage_verdict), str(counts[label])) for label in order),
      swatches=tuple(colors[label] for label in order))
  return html.render_model_html(model_lib.build_model(cfg, abstract=True),
                                title=f"Qwix rule coverage: {key_set(cfg, overrides)}", annotations=labels,
                                colors=colors, tables=(glance, legend) if report.glance else (legend,))


def _label_rank(label: str) -> tuple:
  """Rules in index order, then "unquantized"."""
  if label.startswith("rule "):
    return (0, int(label.split()[1]), label)
  return (1, 0, label)


def _label_meaning(report, label: str, coverage_verdict) -> str:
  if not label.startswith("rule "):
    return "no rule won the module's ops: they run unquantized"
  index = int(label.split()[1])
  rule = report.rules[index].rule
  ops = ", ".join(rule.op_names) or "any op"
  how = (f"quantized {coverage_verdict.types_text(rule)}" if rule.weight_qtype is not None
         else "matched, no weight type: unquantized")
  return f"rule {index}: module_path {rule.module_path}, op_names {ops}; {how}"
