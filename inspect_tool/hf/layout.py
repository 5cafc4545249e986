"""Where a Hugging Face DeepSeek tensor belongs: the summary groups of `inspect_tool.paramtree.summary` for HF names.

`model.layers.{i}` is a dense layer, a MoE layer (it has `mlp.experts` / `mlp.gate`) or an MTP layer (it has
`enorm`/`hnorm`/`eh_proj`, DeepSeek-V3's layer 61); `config.json` beside the files, when present, gives the
routed-expert fraction for active parameters. DeepSeek-V4's names (`layers.{i}.attn.*`, `ffn.*`, `hc_attn_*`, the
MTP block `mtp.{k}.*`; transformers' save_pretrained puts `model.` in front) split as MaxText's V4 tree does: mHC
mixing, compressors, indexer, hash routing tables, router, routed and shared experts. V4's FP4 expert weights are
listed by their values (`logical_leaves`: int8 bytes beside an e8m0 `.scale` hold two e2m1 values each).
"""

from __future__ import annotations

import os
import re
from typing import Callable, Iterable

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_V4_MTP = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
_MTP_MARKERS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
_EMBEDDING = ("model.embed_tokens.", "embed.")
_HEAD = ("lm_head.", "model.norm.", "head.", "norm.")
_HC_HEAD = ("hc_head_", "model.hc_head.")
_PARTS = (  # (prefixes of a layer's rest, part), first match wins
    (("hc_attn_", "hc_ffn_"), "mHC mixing"), (("attn.indexer.",), "indexer"),
    (("attn.compressor.",), "compressors"), (("ffn.gate.tid2eid",), "hash routing tables"),
    (("mlp.gate.", "ffn.gate."), "router"), (("mlp.experts.", "ffn.experts."), "routed experts"),
    (("mlp.shared_experts.", "ffn.shared_experts."), "shared experts"),
)


def logical_leaves(leaves: Iterable[tree.Leaf]) -> list[tree.Leaf]:
  """`leaves` with every packed FP4 weight (int8 / uint8 beside a float8_e8m0fnu `.scale`) as its e2m1 values."""
  leaves = list(leaves)
  dtypes = {leaf.key: leaf.dtype for leaf in leaves}
  out = []
  for leaf in leaves:
    if (leaf.dtype in ("int8", "uint8") and leaf.key[-1:] == ("weight",) and leaf.shape
        and dtypes.get(leaf.key[:-1] + ("scale",)) == "float8_e8m0fnu"):
      leaf = tree.Leaf(leaf.key, tuple(leaf.shape[:-1]) + (2 * leaf.shape[-1],), "float4_e2m1fn")
    out.append(leaf)
  return out


def _part(rest: str, group: str) -> str:
  for prefixes, part in _PARTS:
    if rest.startswith(prefixes):
      return part
  return "attention and norms" if group == "moe stack" else "attention, norms and projection"


def classifier(leaves: Iterable[tree.Leaf]) -> Callable[[tree.Leaf], tuple[str, str]]:
  """A function leaf → (group, part) for the HF names among `leaves` (others go to "other")."""
  layers = [(int(m[1]), m[2]) for m in (_LAYER.match(leaf.dotted) for leaf in leaves) if m]
  mtp = {i for i, rest in layers if rest.startswith(_MTP_MARKERS)}
  moe = {i for i, rest in layers if rest.startswith(("mlp.experts.", "mlp.gate.", "ffn.experts.", "ffn.gate."))}

  def classify(leaf: tree.Leaf) -> tuple[str, str]:
    name = leaf.dotted
    if name.startswith(_EMBEDDING):
      return "embedding", ""
    if name.startswith(_HC_HEAD):
      return "head", "mHC mixing"
    if name.startswith(_HEAD):
      return "head", ""
    v4_mtp = _V4_MTP.match(name)
    if v4_mtp:
      return "mtp block", _part(v4_mtp[2], "mtp block")
    match = _LAYER.match(name)
    if not match:
      return "other", ""
    index, rest = int(match[1]), match[2]
    if index not in mtp and index not in moe:
      return "dense stack", ""
    group = "mtp block" if index in mtp else "moe stack"
    if group == "mtp block" and rest.startswith(("embed_tokens.", "shared_head.head.")):
      return group, "embedding and head copies"
    return group, _part(rest, group)

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
