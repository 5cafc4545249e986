"""Parameter listings: model config, Orbax checkpoint or HF safetensors → `ParamReport`.

The three sources end in the same report, so every command prints the same way.
"""

from __future__ import annotations

from inspect_tool.configuration import config as config_lib
from inspect_tool import progress
from inspect_tool.report import listing


def routed_fraction(cfg: config_lib.ModelConfig) -> float:
  return cfg.num_experts_per_tok / cfg.num_experts


def model_source(tokens) -> str:
  return "maxtext " + " ".join(tokens)


def model_listing(cfg: config_lib.ModelConfig, *, include_all: bool = False, source: str = "", key_filter=None,
                  fp8_column: bool = False):
  """Builds the model abstractly and reports its parameter tree. Returns (report, abstract model).

  `key_filter`: `select.KeyFilter` (`--filter`). `fp8_column`: size the summary's fp8 column by the config's
  quantization rules (MaxText's fp8_full when it sets none): one abstract trace of the rules, so only when shown.
  """
  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import fp8_size, params  # pylint: disable=import-outside-toplevel

  with progress.step(f"building {cfg.model_name} abstractly"):
    model = model_lib.build_model(cfg, abstract=True)
  leaves = params.param_leaves(model, include_non_params=include_all)
  fp8 = fp8_size.for_config(cfg) if fp8_column else None
  return listing.build_report(source or cfg.model_name, leaves, include_all=include_all,
                              routed_fraction=routed_fraction(cfg), config=config_lib.echo(cfg),
                              key_filter=key_filter, fp8=fp8), model


def orbax_listing(path: str, *, include_all: bool = False, cfg: config_lib.ModelConfig | None = None,
                  key_filter=None):
  """Reads an Orbax checkpoint's metadata (never its arrays) and reports it.

  An FP8 export (`quantization_report.json`) is said so in a note; its scales are counted apart either way.
  """
  from inspect_tool.checkpoint import locate, orbax_metadata  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import load as export_load  # pylint: disable=import-outside-toplevel

  resolved = locate.resolve_orbax_path(path)
  leaves = orbax_metadata.read_leaves(resolved.items_dir)
  notes = (resolved.note,) if resolved.note else ()
  if export_load.is_export(resolved.items_dir):
    notes += (f"an FP8 export ({export_load.find_report(resolved.items_dir)}): each quantized weight is "
              "array.qvalue (its parameters) + array.scale (counted apart as scales)",)
  return listing.build_report(path, leaves, include_all=include_all,
                              routed_fraction=routed_fraction(cfg) if cfg else None, notes=notes,
                              key_filter=key_filter)


def hf_listing(path: str, *, key_filter=None):
  """Reads safetensors headers (never tensor data) and reports every tensor (`weight_scale_inv` as scales)."""
  from inspect_tool.checkpoint import hf_layout, safetensors_header  # pylint: disable=import-outside-toplevel

  leaves = safetensors_header.read_leaves(path)
  return listing.build_report(path, leaves, include_all=True, count_all=True, classify=hf_layout.classifier(leaves),
                              routed_fraction=hf_layout.routed_fraction(path), key_filter=key_filter)
