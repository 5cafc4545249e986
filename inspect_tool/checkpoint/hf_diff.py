"""Does a Hugging Face DeepSeek checkpoint fit a model? The model's leaves against the tensors the reader needs.

Each model leaf is looked up through the exporter's names (`hf_names.leaf_plan`) and stands in the comparison
as the leaf the reader would assemble: present (at the model's dtype: every float layout loads) when every
tensor of it is there with the (out, in) shape the model needs, mis-shaped (at the stored tensor's shape) or
missing otherwise, with the HF tensor named in a cause. Tensors no leaf reads are unexpected; `config.json`
fields that differ from the model suggest the keys to change.
"""

from __future__ import annotations

import os

from inspect_tool.configuration import config as config_lib
from inspect_tool import errors
from inspect_tool.paramtree import listings
from inspect_tool.paramtree import tree
from inspect_tool.checkpoint import diff
from inspect_tool.checkpoint import files
from inspect_tool.checkpoint import hf_names
from inspect_tool.checkpoint import hf_restore
from inspect_tool.checkpoint import safetensors_header

# config.json field -> (ModelConfig attribute, MaxText key that sets it).
_CONFIG_FIELDS = (
    ("num_hidden_layers", "num_decoder_layers", "base_num_decoder_layers"),
    ("num_nextn_predict_layers", "mtp_num_layers", "mtp_num_layers"),
    ("vocab_size", "vocab_size", "vocab_size"),
    ("hidden_size", "emb_dim", "base_emb_dim"),
    ("num_attention_heads", "num_query_heads", "base_num_query_heads"),
    ("n_routed_experts", "num_experts", "num_experts"),
    ("first_k_dense_replace", "first_num_dense_layers", "first_num_dense_layers"),
    ("moe_intermediate_size", "moe_mlp_dim", "base_moe_mlp_dim"),
    ("intermediate_size", "mlp_dim", "base_mlp_dim"),
)


def _config_causes(path: str, cfg) -> list[diff.Cause]:
  config_path = os.path.join(path, hf_restore.CONFIG_NAME)
  if files.kind(config_path) != "file":  # optional; a FIFO in its place must not block the diff
    return []
  doc = files.parse_json(files.read_bytes(config_path, 1 << 20, "Hugging Face config"),
                         lambda why: errors.CheckpointError(f"{config_path}: {why}"))
  causes = []
  for field, attr, key in _CONFIG_FIELDS:
    value = doc.get(field) if isinstance(doc, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value != getattr(cfg, attr):
      causes.append(diff.Cause(key, f"config.json has {field}={value}, the model {getattr(cfg, attr)}",
                               f"{key}={value}"))
  return causes


def _as_maxtext(entry, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
  """A mis-shaped tensor's shape as the MaxText leaf would have it, where that is plain: a 2-D Linear weight
  (out, in) of a 2-D kernel is (in, out); other shapes are shown as stored."""
  linear = entry.rule.kind in (hf_names.FP8, hf_names.BF16_LINEAR)
  if linear and entry.layer_axis is None and len(entry.shape) == 2 and len(hf_shape) == 2:
    return hf_shape[::-1]
  return hf_shape


def diff_hf(cfg, path: str, model_leaves: list[tree.Leaf]) -> diff.DiffResult:
  """Compares `model_leaves` of `cfg` with the Hugging Face checkpoint at `path` (headers only)."""
  plan = hf_names.leaf_plan(cfg)
  tensors = hf_restore.Tensors(path)
  problems, known = hf_restore.check(tensors, plan, cfg)
  by_key = {p.key: p for p in problems}
  ckpt = []
  for leaf, target in hf_restore.planned(model_leaves, plan):
    problem = by_key.get(target)
    if problem is None:
      ckpt.append(tree.Leaf(leaf.key, plan[target].shape, leaf.dtype))
    elif problem.shape is not None:
      ckpt.append(tree.Leaf(leaf.key, _as_maxtext(plan[target], problem.shape), leaf.dtype))
  for name in tensors.table:
    if name not in known:
      ckpt.append(tree.Leaf(tuple(name.split(".")), tensors.shape(name),
                            safetensors_header.dtype_name(tensors.dtype(name))))
  result = diff.diff_leaves(model_leaves, ckpt)
  if problems:
    shown = "; ".join(p.text for p in problems[:3])
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    result.causes.append(diff.Cause("hf_tensors", f"Hugging Face tensors: {shown}{more}"))
  if not result.agree:
    result.causes.extend(_config_causes(path, cfg))
  return result


def diff_config_hf(tokens, path: str):
  """Returns (model description, `DiffResult`) for `key=value` tokens and a Hugging Face checkpoint directory."""
  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import params  # pylint: disable=import-outside-toplevel

  cfg = config_lib.resolve_config(tokens)
  leaves = params.param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)
  return listings.model_source(tokens) + " (Hugging Face DeepSeek names)", diff_hf(cfg, path, leaves)
