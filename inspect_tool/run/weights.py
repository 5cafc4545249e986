"""Which weights a run used, in words, for `forward` and `export` to print: nothing is left to guess.

`describe(cfg, checkpoint)`: "random init, seed 0", "Orbax checkpoint /abs/ckpt/1000/items (step 1000)",
"FP8 export /abs/fp8-export" (or "int8 export ..."), or "Hugging Face directory /abs/hf (fp8 block-quantized)". The
checkpoint kinds are recognised in the order `runner.load_model` tries them.
"""

from __future__ import annotations

import json
import os

from inspect_tool import errors
from inspect_tool.checkpoint import exports
from inspect_tool.checkpoint import files
from inspect_tool.hf import restore as hf_restore
from inspect_tool.checkpoint import locate
from inspect_tool.storage import paths

RANDOM_WARNING = ("warning: --compare on random-init weights (seed {seed}): these figures compare the quantized and "
                  "unquantized random model and say nothing about a trained model; pass --checkpoint for that")


def is_random(checkpoint: str | None) -> bool:
  return not checkpoint


def describe(cfg, checkpoint: str | None) -> str:
  """The weights of a run of `cfg` from `checkpoint` (None: the seeded random init)."""
  if is_random(checkpoint):
    return f"random init, seed {cfg.init_weights_seed}"
  path = paths.absolute(checkpoint)
  if hf_restore.is_hf_checkpoint(checkpoint):
    return f"Hugging Face directory {path}{_hf_kind(checkpoint)}"
  if exports.is_export(checkpoint):
    return f"{exports.label(checkpoint)} {os.path.dirname(exports.find_report(checkpoint))}"
  resolved = locate.resolve_orbax_path(checkpoint)
  step = f" (step {resolved.step})" if resolved.step is not None else " (no step number)"
  return f"Orbax checkpoint {paths.absolute(resolved.items_dir)}{step}"


def _hf_kind(path: str) -> str:
  """" (fp8 block-quantized)" when config.json declares an fp8 `quantization_config`, else ""."""
  try:
    quant = json.loads(files.read_bytes(paths.join(path, "config.json"), 1 << 20)).get("quantization_config") or {}
  except (errors.InspectError, OSError, ValueError, AttributeError):
    return ""
  return " (fp8 block-quantized)" if isinstance(quant, dict) and quant.get("quant_method") == "fp8" else ""
