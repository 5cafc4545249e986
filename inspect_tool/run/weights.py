"""Which weights a run used, in words, for `forward` and `export` to print: nothing is left to guess.

`resolve(cfg, checkpoint)` once per run (`Weights`, handed down to the reads), and its words: "random init, seed 0",
"Orbax checkpoint /abs/ckpt/1000/items (step 1000)", "FP8 export /abs/fp8-export" (or "int8 export ..."), or
"Hugging Face directory /abs/hf (fp8 block-quantized)". The kinds are told apart in the order `runner.load_model`
loads them.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Weights:
  """A run's weights, resolved once (by the command that was given them): what `--checkpoint` named (None: the
  seeded random init), which kind it is (`RANDOM`, `HF`, `EXPORT`, `ORBAX`), where an Orbax checkpoint's pytree is
  (its step chosen once: a step written meanwhile is not taken halfway through a run), and the words that say so."""
  given: str | None
  kind: str
  label: str
  resolved: locate.ResolvedPath | None = None


RANDOM, HF, EXPORT, ORBAX = "random", "hf", "export", "orbax"


def resolve(cfg, checkpoint: str | Weights | None) -> Weights:
  """The weights of a run of `cfg` from `checkpoint` (None: the seeded random init; `Weights`: as they are)."""
  if isinstance(checkpoint, Weights):
    return checkpoint
  if is_random(checkpoint):
    return Weights(None, RANDOM, f"random init, seed {cfg.init_weights_seed}")
  if hf_restore.is_hf_checkpoint(checkpoint):
    return Weights(checkpoint, HF, f"Hugging Face directory {paths.absolute(checkpoint)}{_hf_kind(checkpoint)}")
  if exports.is_export(checkpoint):
    return Weights(checkpoint, EXPORT,
                   f"{exports.label(checkpoint)} {os.path.dirname(exports.find_report(checkpoint))}")
  resolved = locate.resolve_orbax_path(checkpoint)
  step = f" (step {resolved.step})" if resolved.step is not None else " (no step number)"
  return Weights(checkpoint, ORBAX, f"Orbax checkpoint {paths.absolute(resolved.items_dir)}{step}", resolved)


def given(checkpoint: str | Weights | None) -> str | None:
  """The path the user gave (None: the random init), from a path or resolved `Weights`."""
  return checkpoint.given if isinstance(checkpoint, Weights) else checkpoint


def _hf_kind(path: str) -> str:
  """" (fp8 block-quantized)" when config.json declares an fp8 `quantization_config`, else ""."""
  try:
    quant = json.loads(files.read_bytes(paths.join(path, "config.json"), 1 << 20)).get("quantization_config") or {}
  except (errors.InspectError, OSError, ValueError, AttributeError):
    return ""
  return " (fp8 block-quantized)" if isinstance(quant, dict) and quant.get("quant_method") == "fp8" else ""
