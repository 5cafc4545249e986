"""The listing of Hugging Face safetensors from their headers alone (no tensor data), as a `ParamReport`."""

from __future__ import annotations

from inspect_tool.hf import layout as hf_layout
from inspect_tool.hf import safetensors_header
from inspect_tool.report import listing


def hf_listing(path: str, *, key_filter=None):
  """Reads safetensors headers (never tensor data) and reports every tensor (`weight_scale_inv` and V4's `.scale`
  as scales, V4's packed FP4 weights by their values)."""
  leaves = hf_layout.logical_leaves(safetensors_header.read_leaves(path))
  return listing.build_report(path, leaves, include_all=True, count_all=True, classify=hf_layout.classifier(leaves),
                              routed_fraction=hf_layout.routed_fraction(path), key_filter=key_filter)
