"""Export stage 1, the plan: which weights of the config's model are exported quantized, and how.

The config's Qwix rules are traced over one abstract forward pass (`model_coverage.trace_coverage`); every op
a rule quantizes names the weight it consumes, the axes it contracts and the dtype it sees. Each such weight is
exported at the granularity that forward pass uses (`quant.ptq_weights`): dense kernels, routers and heads (Qwix QT
`dot_general`) one scale per non-contracted axis; routed experts (our `gmm`, or Qwix's quantized `ragged_dot`
with megablox=false) one scale per output column shared by the experts; a scanned stack's layer axis always keeps
its own scales. Weights consumed by no quantizing op (norms, embedding, the DeepSeek-V3 gate bias, unmatched
kernels) are copied unchanged (same dtype).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from inspect_tool import errors
from inspect_tool import progress
from inspect_tool.configuration import config as config_lib
from inspect_tool.coverage import trace as model_coverage
from inspect_tool.model import initializers
from inspect_tool.paramtree import fp8_size
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from quant import errors as quant_errors
from quant import fp8
from quant import ptq_weights


@dataclasses.dataclass(frozen=True)
class ExportPlan:
  """Which weights of the config's model are exported quantized, and how."""

  cfg: config_lib.ModelConfig
  rules: tuple
  coverage: Any  # inspect_tool.report.coverage_report.CoverageReport
  weights: dict  # model leaf key -> quant.ptq_weights.WeightQuant

  def exported_leaves(self, model_leaves: Sequence[tree.Leaf]) -> list[tree.Leaf]:
    """The exported checkpoint's leaves: model leaves with quantized weights as qvalue + scale."""
    out = []
    for leaf in model_leaves:
      wq = self.weights.get(leaf.key)
      if wq is None:
        out.append(leaf)
        continue
      out.append(tree.Leaf(wq.qvalue_key, wq.shape, wq.qtype))
      out.append(tree.Leaf(wq.scale_key, wq.scale_shape, wq.compute_dtype))
    return tree.sort_leaves(out)


def _layer_axis(cfg, stored_ndim: int) -> int:
  return initializers.layer_axis(stored_ndim - 1, cfg.param_scan_axis)


def plan_export(cfg: config_lib.ModelConfig, rules: Sequence | None = None) -> ExportPlan:
  """Traces the config's rules (or `rules`) and plans the export of every weight a quantizing op consumes.

  Raises:
    errors.ConfigError: the config quantizes nothing.
    quant.errors.QuantError: a weight cannot be exported (unsupported qtype or rule, or its ops disagree).
  """
  rule_list = model_coverage.config_rules(cfg) if rules is None else list(rules)
  if not rule_list:
    raise errors.ConfigError("export needs a quantization; pass e.g. quantization=fp8_full "
                             "(accepted: any quantization mode with fp8 weights)")
  with progress.step("tracing quantization rules"):
    report = model_coverage.trace_coverage(cfg, None if rules is None else rule_list)  # None: reasons name keys
  planned: dict = {}
  for op in report.ops:
    if not (op.matmul and op.weight and report.op_quantized(op)):
      continue
    rule = report.rules[op.rule].rule
    if op.operand_shape is None or op.contracting is None:
      raise quant_errors.QuantError(f"cannot tell how {op.module}:{op.op} consumes {op.weight}; export needs the "
                                    "weight operand of every quantized op")
    local = ptq_weights.op_channel_axes(op.op_name, len(op.operand_shape), op.contracting, rule)
    stored_shape = tuple(op.weight_shape)
    extra = ptq_weights.extra_axes(op.operand_shape, stored_shape, preferred=_layer_axis(cfg, len(stored_shape)))
    wq = ptq_weights.WeightQuant(
        key=tree.param_key(tuple(op.weight.split("/"))), shape=stored_shape,
        channel_axes=ptq_weights.stored_channel_axes(local, op.operand_shape, stored_shape, extra),
        qtype=fp8.resolve_qtype(rule.weight_qtype, integers=True).name,
        calibration=rule.weight_calibration_method or "absmax",
        compute_dtype=op.operand_dtype, kind="grouped" if op.op_name in ptq_weights.GROUPED_OPS else "dense",
        ops=(f"{op.module}:{op.op}",))
    previous = planned.get(wq.key)
    if previous is not None:
      if dataclasses.replace(previous, ops=()) != dataclasses.replace(wq, ops=()):
        raise quant_errors.QuantError(f"weight {op.weight} is quantized differently by {previous.ops[0]} and "
                                      f"{wq.ops[0]}; export needs one granularity per weight")
      wq = dataclasses.replace(previous, ops=previous.ops + wq.ops)
    planned[wq.key] = wq
  for row in report.weights:  # a weight stored quantized must be quantized by every op that reads it
    key = tree.param_key(tuple(row.weight.split("/")))
    if key in planned and len(planned[key].ops) != len(row.ops):
      plain = [o for o in row.ops if o not in planned[key].ops]
      raise quant_errors.QuantError(f"weight {row.weight} is quantized by {planned[key].ops[0]} but read "
                                    f"unquantized by {plain[0]}; export needs every op of a weight to quantize it")
  return ExportPlan(cfg=cfg, rules=tuple(rule_list), coverage=report, weights=planned)


def orbax_export_leaves(cfg: config_lib.ModelConfig) -> list[tree.Leaf]:
  """The leaves an Orbax export of this config holds (quantized weights as `array/qvalue` + `array/scale`)."""
  return plan_export(cfg).exported_leaves(params.model_leaves(cfg))


def fp8_sizing(cfg) -> fp8_size.Fp8Sizing | None:
  """The summary's fp8 column under the config's own rules, or MaxText's `quantization=fp8_full` when it sets none;
  None if they cannot export."""
  return sized_plan(cfg)[0]


def sized_plan(cfg) -> tuple[fp8_size.Fp8Sizing | None, ExportPlan | None]:
  """(`fp8_sizing(cfg)`, the export plan under the config's own rules, None when it sets no quantization or its
  rules cannot export): one trace for both."""
  try:
    if cfg.quantization:
      plan = plan_export(cfg)
      return fp8_size.from_plan(plan, f"quantization={cfg.quantization} rules"), plan
    rules = model_coverage.config_rules(cfg.replace(quantization="fp8_full"))
    return fp8_size.from_plan(plan_export(cfg, rules), "quantization=fp8_full rules"), None
  except (errors.InspectError, quant_errors.QuantError):  # e.g. a batch-split model: MaxText's own fp8 path
    return None, None
