"""The listing of an Orbax checkpoint from its metadata alone (no array is read), as a `ParamReport`."""

from __future__ import annotations

from inspect_tool.checkpoint import exports
from inspect_tool.checkpoint import locate
from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.configuration import config as config_lib
from inspect_tool.report import listing


def orbax_listing(path: str, *, include_all: bool = False, cfg: config_lib.ModelConfig | None = None,
                  key_filter=None):
  """Reads an Orbax checkpoint's metadata (never its arrays) and reports it.

  An export (`quantization_report.json`, FP8 or int8) is said so in a note; its scales are counted apart either way.
  """
  resolved = locate.resolve_orbax_path(path)
  leaves = orbax_metadata.read_leaves(resolved.items_dir)
  notes = (resolved.note,) if resolved.note else ()
  if exports.is_export(resolved.items_dir):
    notes += (f"an {exports.label(resolved.items_dir)} ({exports.find_report(resolved.items_dir)}): each "
              "quantized weight is array.qvalue (its parameters) + array.scale (counted apart as scales)",)
  return listing.build_report(path, leaves, include_all=include_all,
                              routed_fraction=config_lib.routed_fraction(cfg) if cfg else None, notes=notes,
                              key_filter=key_filter)
