"""Where a Hugging Face DeepSeek tensor belongs: the summary groups of `inspect_tool.paramtree.summary` for HF names.

`model.layers.{i}` is a dense layer, a MoE layer (it has `mlp.experts` / `mlp.gate`) or an MTP layer (it has
`enorm`/`hnorm`/`eh_proj`, DeepSeek-V3's layer 61); `config.json` beside the files, when present, gives the
routed-expert fraction for active parameters.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Iterable

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_MARKERS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def classifier(leaves: Iterable[tree.Leaf]) -> Callable[[tree.Leaf], tuple[str, str]]:
  """A function leaf → (group, part) for the HF names among `leaves` (others go to "other")."""
  layers = [(int(m[1]), m[2]) for m in (_LAYER.match(leaf.dotted) for leaf in leaves) if m]
  mtp = {i for i, rest in layers if rest.startswith(_MTP_MARKERS)}
  moe = {i for i, rest in layers if rest.startswith(("mlp.experts.", "mlp.gate."))}

  def classify(leaf: tree.Leaf) -> tuple[str, str]:
    name = leaf.dotted
    if name.startswith("model.embed_tokens."):
      return "embedding", ""
    if name.startswith(("lm_head.", "model.norm.")):
      return "head", ""
    match = _LAYER.match(name)
    if not match:
      return "other", ""
    index, rest = int(match[1]), match[2]
    if index not in mtp and index not in moe:
      return "dense stack", ""
    group = "mtp block" if index in mtp else "moe stack"
    if rest.startswith("mlp.gate."):
      return group, "router"
    if rest.startswith("mlp.experts."):
      return group, "routed experts"
    if rest.startswith("mlp.shared_experts."):
      return group, "shared experts"
    if group == "mtp block" and rest.startswith(("embed_tokens.", "shared_head.head.")):
      return group, "embedding and head copies"
    return group, "attention and norms" if group == "moe stack" else "attention, norms and projection"

  return classify


def routed_fraction(path: str) -> float | None:
  """num_experts_per_tok / n_routed_experts from the `config.json` beside the safetensors files, if any.

  A config.json that is not a small regular file of strict JSON with a fraction in (0, 1] is ignored (None).
  """
  try:
    if paths.is_url(path):
      directory = path if files.kind(path) == "dir" else paths.parent(path)
    else:
      directory = path if os.path.isdir(path) else os.path.dirname(path)
    config_path = paths.join(directory, "config.json")
    if files.kind(config_path) != "file":
      return None
    config = files.parse_json(files.read_bytes(config_path, 1 << 20), errors.CheckpointError)
    fraction = float(config["num_experts_per_tok"]) / float(config["n_routed_experts"])
  except (errors.CheckpointError, ValueError, KeyError, TypeError, ZeroDivisionError, OverflowError):
    return None
  return fraction if 0 < fraction <= 1 else None
