"""What marks a checkpoint as an export (`inspect_checkpoint export`, FP8 or int8): its `quantization_report.json`
beside the step directories, and the quantization keys the report says it was made with. Reading these is metadata
only.
"""

from __future__ import annotations

import json
import os

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.storage import objects
from inspect_tool.storage import paths

REPORT_NAME = "quantization_report.json"
MARK = "fp8_export"  # attribute set on a loaded model: the checkpoint it came from


def find_report(path: str | None) -> str | None:
  """The `quantization_report.json` of the export `path` points into (DST, DST/0 or DST/0/items), or None."""
  if not path:
    return None
  path = paths.absolute(os.fspath(path))
  candidates = [path, paths.parent(path), paths.parent(paths.parent(path))]
  for directory in candidates:
    report = paths.join(directory, REPORT_NAME)
    if objects.exists(report) if paths.is_remote(report) else os.path.isfile(report):
      return report
  return None


def is_export(path: str | None) -> bool:
  return find_report(path) is not None


def read_report(path: str) -> dict:
  """The export's report as a dict ({} when unreadable: the checkpoint itself is what counts)."""
  report = find_report(path)
  if report is None:
    return {}
  try:
    data = json.loads(files.read_bytes(report, 16 << 20))
  except (OSError, ValueError, errors.InspectError):
    return {}
  return data if isinstance(data, dict) else {}


def label(path: str) -> str:
  """"int8 export" when every weight the report lists is int8 (quantization=int8), else "FP8 export"."""
  weights = read_report(path).get("weights")
  qtypes = {w.get("qtype") for w in weights if isinstance(w, dict)} if isinstance(weights, list) else set()
  return "int8 export" if qtypes == {"int8"} else "FP8 export"


def is_quantized_model(model) -> bool:
  """Whether `model` was loaded from an FP8 export (its quantization lives in its weights)."""
  return bool(getattr(model, MARK, None))


def export_keys_hint(path: str) -> str:
  """The quantization key=value tokens the export was made with, from its report ('' if unknown)."""
  overrides = read_report(path).get("config", {}).get("overrides", [])
  keys = ("quantization", "quantize_mtp", "quantize_router_proj", "quantize_logits_proj")
  return " ".join(t for t in overrides if isinstance(t, str) and t.split("=", 1)[0] in keys)
