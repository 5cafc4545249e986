"""Does a checkpoint fit a model? The model's expected leaves (quantized ones included) against the metadata.

An FP8 export (recognised by its `quantization_report.json`) is compared with the layout `export` writes for the
config's quantization; without quantization keys the differences name the keys the export was made with.
"""

from __future__ import annotations

from inspect_tool import model as model_lib
from inspect_tool.checkpoint import diff
from inspect_tool.checkpoint import exports
from inspect_tool.checkpoint import locate
from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.configuration import config as config_lib
from inspect_tool.coverage import plan
from inspect_tool.paramtree import params


def config_checkpoint_leaves(cfg: config_lib.ModelConfig, *, quantized: bool = False):
  """The leaves a checkpoint of this config holds: Params and non-Param state, or their exported FP8 form.

  `quantized`: the layout `inspect_checkpoint export` writes for the config's quantization (every weight a
  quantizing op consumes as `<key>/array/qvalue` + `<key>/array/scale`).
  """
  if quantized:
    return plan.orbax_export_leaves(cfg)
  return params.param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)


def diff_config_checkpoint(tokens, path: str):
  """Returns (model description, `DiffResult`) for `key=value` tokens and an Orbax checkpoint path."""
  cfg = config_lib.resolve_config(tokens)
  resolved = locate.resolve_orbax_path(path)
  ckpt_leaves = orbax_metadata.read_leaves(resolved.items_dir)
  export = exports.is_export(resolved.items_dir)  # quantization_report.json beside the steps
  quantized = export and bool(cfg.quantization)
  result = diff.diff_leaves(config_checkpoint_leaves(cfg, quantized=quantized), ckpt_leaves)
  if export and not result.agree:
    hint = exports.export_keys_hint(resolved.items_dir)
    if not quantized:
      result.causes.append(diff.Cause("quantization", f"the checkpoint is an {exports.label(resolved.items_dir)} but "
                                      "the model has no quantization", hint or "quantization=fp8_full"))
    elif hint and not set(hint.split()) <= set(tokens):
      result.causes.append(diff.Cause("quantization", f"the checkpoint is an {exports.label(resolved.items_dir)} "
                                      f"made with {hint}", hint))
  source = config_lib.model_source(tokens) + (f" ({exports.label(resolved.items_dir)} layout)" if quantized else "")
  return source, result
