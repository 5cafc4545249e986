"""The listing of a config's model: built abstractly (no memory), its parameter tree as a `ParamReport`."""

from __future__ import annotations

from inspect_tool import model as model_lib
from inspect_tool import progress
from inspect_tool.configuration import config as config_lib
from inspect_tool.coverage import plan
from inspect_tool.paramtree import params
from inspect_tool.report import listing


def model_listing(cfg: config_lib.ModelConfig, *, include_all: bool = False, source: str = "", key_filter=None,
                  fp8_column: bool = False):
  """Builds the model abstractly and reports its parameter tree. Returns (report, abstract model).

  `key_filter`: `select.KeyFilter` (`--filter`). `fp8_column`: size the summary's fp8 column by the config's
  quantization rules (MaxText's fp8_full when it sets none): one abstract trace of the rules, so only when shown.
  """
  with progress.step(f"building {cfg.model_name} abstractly"):
    model = model_lib.build_model(cfg, abstract=True)
  leaves = params.param_leaves(model, include_non_params=include_all)
  fp8 = plan.fp8_sizing(cfg) if fp8_column else None
  return listing.build_report(source or cfg.model_name, leaves, include_all=include_all,
                              routed_fraction=config_lib.routed_fraction(cfg), config=config_lib.echo(cfg),
                              key_filter=key_filter, fp8=fp8), model
