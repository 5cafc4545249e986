"""Does a Hugging Face DeepSeek checkpoint fit a model? The model's leaves against the tensors the reader needs.

Each model leaf is looked up through the exporter's names (`hf_names.leaf_plan`) and stands in the comparison
as the leaf the reader would assemble: present (at the model's dtype: every float layout loads) when every
tensor of it is there with the (out, in) shape the model needs, mis-shaped (at the stored tensor's shape) or
missing otherwise, with the HF tensor named in a cause. Tensors no leaf reads are unexpected (DeepSeek-V4's MTP
block `mtp.*` among them: MaxText's deepseek4 decoder has none). A model leaf with no HF DeepSeek tensor at all
(custom's modules) is missing. The keys `config.json` determines
(`hf_config.derive_keys`) that the model computes differently are conflicts: the model and checkpoint then
disagree even where every shape fits (routing, RoPE, norm epsilon...).
"""

from __future__ import annotations

from inspect_tool import model as model_lib
from inspect_tool.checkpoint import diff
from inspect_tool.hf import config as hf_config
from inspect_tool.hf import names as hf_names
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.hf import restore as hf_restore
from inspect_tool.hf import safetensors_header
from inspect_tool.configuration import config as config_lib
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree

def _as_maxtext(entry, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
  """A mis-shaped tensor's shape as the MaxText leaf would have it, where that is plain: a 2-D Linear weight
  (out, in) of a 2-D kernel is (in, out); other shapes are shown as stored."""
  linear = entry.rule.kind in (hf_names.FP8, hf_names.BF16_LINEAR)
  if linear and entry.layer_axis is None and len(entry.shape) == 2 and len(hf_shape) == 2:
    return hf_shape[::-1]
  return hf_shape


def diff_hf(cfg, path: str, model_leaves: list[tree.Leaf]) -> diff.DiffResult:
  """Compares `model_leaves` of `cfg` with the Hugging Face checkpoint at `path` (headers and config.json)."""
  keys = hf_config.derive_keys(path)
  tensors = hf_restore.Tensors(path)
  tensors.check_format()
  plan = hf_names_v4.plan(cfg, tensors.table)
  problems, known = hf_restore.check(tensors, plan, cfg)
  by_key = {p.key: p for p in problems}
  ckpt, unplanned = [], []
  for leaf, target in hf_restore.planned(model_leaves, plan):
    if target is None:
      unplanned.append(leaf)
      continue
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
  if unplanned:
    result.causes.append(diff.Cause("hf_layout", f"{len(unplanned)} model weight(s) have no Hugging Face DeepSeek "
                                    f"tensor (e.g. {unplanned[0].dotted}): the model is not a DeepSeek-V2/V3/V3.2/V4"))
  for text in hf_config.differences(path):
    result.causes.append(diff.Cause("hf_not_in_maxtext", f"config.json: {text} (no MaxText key runs it)"))
  mtp = hf_names_v4.mtp_tensors(tensors.table) if cfg.decoder_block == "deepseek4" else []
  if mtp:
    result.causes.append(diff.Cause("hf_mtp", f"DeepSeek-V4's MTP block ({len(mtp)} tensors, e.g. {mtp[0]}): MaxText's "
                                    "deepseek4 decoder has no MTP layers, so no model of these keys reads them"))
  if problems:
    shown = "; ".join(p.text for p in problems[:3])
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    result.causes.append(diff.Cause("hf_tensors", f"Hugging Face tensors: {shown}{more}"))
  found = hf_config.conflicts(cfg, keys, path)
  result.conflicts = [text for _, text in found]
  for key, text in found:
    value = keys.get(key)
    result.causes.append(diff.Cause("config", f"config.json: {text}",
                                    f"{key}={hf_config.format_value(value)}" if value is not None else ""))
  return result


def diff_config_hf(tokens, path: str):
  """Returns (model description, `DiffResult`) for `key=value` tokens and a Hugging Face checkpoint directory."""
  cfg = config_lib.resolve_config(tokens)
  leaves = params.param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)
  return config_lib.model_source(tokens) + " (Hugging Face DeepSeek names)", diff_hf(cfg, path, leaves)
