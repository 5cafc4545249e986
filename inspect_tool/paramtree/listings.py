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


def model_listing(cfg: config_lib.ModelConfig, *, include_all: bool = False, source: str = ""):
  """Builds the model abstractly and reports its parameter tree. Returns (report, abstract model)."""
  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import params  # pylint: disable=import-outside-toplevel

  with progress.step(f"building {cfg.model_name} abstractly"):
    model = model_lib.build_model(cfg, abstract=True)
  leaves = params.param_leaves(model, include_non_params=include_all)
  return listing.build_report(source or cfg.model_name, leaves, include_all=include_all,
                              routed_fraction=routed_fraction(cfg), config=config_lib.echo(cfg)), model


def orbax_listing(path: str, *, include_all: bool = False, cfg: config_lib.ModelConfig | None = None):
  """Reads an Orbax checkpoint's metadata (never its arrays) and reports it."""
  from inspect_tool.checkpoint import locate, orbax_metadata  # pylint: disable=import-outside-toplevel

  resolved = locate.resolve_orbax_path(path)
  leaves = orbax_metadata.read_leaves(resolved.items_dir)
  notes = (resolved.note,) if resolved.note else ()
  return listing.build_report(path, leaves, include_all=include_all,
                              routed_fraction=routed_fraction(cfg) if cfg else None, notes=notes)


def hf_listing(path: str):
  """Reads safetensors headers (never tensor data) and reports every tensor."""
  from inspect_tool.checkpoint import hf_layout, safetensors_header  # pylint: disable=import-outside-toplevel

  leaves = safetensors_header.read_leaves(path)
  return listing.build_report(path, leaves, include_all=True, count_all=True, classify=hf_layout.classifier(leaves),
                              routed_fraction=hf_layout.routed_fraction(path))
