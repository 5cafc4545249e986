"""Import stage 1, the keys: the MaxText keys of a Hugging Face DeepSeek directory, with the user's on top.

The directory determines every key that changes shapes or the computation (`checkpoint.hf_config.derive_keys`:
config.json and the stored tensors). The user may add keys that change neither what is read nor how the model
computes (`scan_layers`, `param_scan_axis`, `weight_dtype`, fewer MTP layers than stored, ...) and may restate
derived ones; a key that contradicts the directory is refused naming its config.json value
(`checkpoint.hf_config.check_keys`).
"""

from __future__ import annotations

from typing import Sequence

from inspect_tool.checkpoint import hf_config
from inspect_tool.configuration import config as config_lib


def maxtext_keys(path: str, tokens: Sequence[str]) -> list[str]:
  """The MaxText `key=value` list the import builds its model from: the derived keys, the user's replacing or
  following them. Raises `errors.ConfigError` for a contradiction, `errors.CheckpointError` for a directory whose
  config.json cannot be read or expressed."""
  merged = dict(config_lib.parse_overrides(hf_config.tokens(hf_config.derive_keys(path))))
  merged.update(config_lib.parse_overrides(tokens))
  keys = [f"{key}={value}" for key, value in merged.items()]
  hf_config.check_keys(config_lib.resolve_config(keys), path)
  return keys
