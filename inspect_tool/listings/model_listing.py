"""The listing of a config's model: built abstractly (no memory), its parameter tree as a `ParamReport`."""

from __future__ import annotations

import dataclasses

from inspect_tool import model as model_lib
from inspect_tool import progress
from inspect_tool.configuration import config as config_lib
from inspect_tool.coverage import plan
from inspect_tool.coverage import trace as model_coverage
from inspect_tool.paramtree import params
from inspect_tool.report import chip_fit
from inspect_tool.report import listing


def model_listing(cfg: config_lib.ModelConfig, *, include_all: bool = False, source: str = "", key_filter=None,
                  fp8_column: bool = False, chip: str | None = None):
  """Builds the model abstractly and reports its parameter tree. Returns (report, abstract model).

  `key_filter`: `select.KeyFilter` (`--filter`). `fp8_column`: size the summary's fp8 column by the config's
  quantization rules (MaxText's fp8_full when it sets none): one abstract trace of the rules, so only when shown.
  `chip` (with `fp8_column`): how the config's quantized matmuls run on that chip (`report.chip_fit`), from the
  same trace.
  """
  with progress.step(f"building {cfg.model_name} abstractly"):
    model = model_lib.build_model(cfg, abstract=True)
  leaves = params.param_leaves(model, include_non_params=include_all)
  fp8, plan_ = plan.sized_plan(cfg) if fp8_column else (None, None)
  report = listing.build_report(source or cfg.model_name, leaves, include_all=include_all,
                                routed_fraction=config_lib.routed_fraction(cfg), config=config_lib.echo(cfg),
                                key_filter=key_filter, fp8=fp8)
  if chip is not None and fp8_column:
    glance = ()
    if cfg.quantization:
      glance = plan_.coverage.glance if plan_ is not None else model_coverage.trace_coverage(cfg).glance
    report = dataclasses.replace(report, glance=glance, chip=chip_fit.build(chip, glance))
  return report, model
