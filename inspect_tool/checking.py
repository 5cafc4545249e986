"""Does a checkpoint fit a model? The model's expected leaves (quantized ones included) against the metadata."""

from __future__ import annotations

from inspect_tool import config as config_lib
from inspect_tool import listings


def expected_leaves(cfg: config_lib.ModelConfig):
  """The leaves a checkpoint of this config holds: Params and non-Param state, or their exported FP8 form."""
  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool import params  # pylint: disable=import-outside-toplevel

  return params.param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)


def diff_config_checkpoint(tokens, path: str):
  """Returns (model description, `DiffResult`) for `key=value` tokens and an Orbax checkpoint path."""
  from inspect_tool.checkpoint import diff, locate, orbax_metadata  # pylint: disable=import-outside-toplevel

  cfg = config_lib.resolve_config(tokens)
  resolved = locate.resolve_orbax_path(path)
  ckpt_leaves = orbax_metadata.read_leaves(resolved.items_dir)
  return listings.model_source(tokens), diff.diff_leaves(expected_leaves(cfg), ckpt_leaves)
