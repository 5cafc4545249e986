"""Import stage 1, the keys: the MaxText keys of a Hugging Face DeepSeek directory, with the user's on top.

The directory determines every key that changes shapes or the computation (`hf.config.derive_keys`:
config.json and the stored tensors). The user may add keys that change neither what is read nor how the model
computes (`scan_layers`, `param_scan_axis`, `weight_dtype`, fewer MTP layers than stored, ...) and may restate
derived ones; a key that contradicts the directory is refused naming its config.json value
(`hf.config.check_keys`).
"""

from __future__ import annotations

from typing import Sequence

from inspect_tool import errors
from inspect_tool.hf import config as hf_config
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.hf import safetensors_header
from inspect_tool.configuration import config as config_lib

MTP_REASON = ("MaxText's deepseek4 decoder has no MTP layers (\"DeepSeek4 decoder block currently does not support "
              "MTP layers\")")


def maxtext_keys(path: str, tokens: Sequence[str]) -> tuple[list[str], config_lib.ModelConfig]:
  """The MaxText `key=value` list the import builds its model from (the derived keys, the user's replacing or
  following them) and the config they resolve to, the directory read once. Raises `errors.ConfigError` for a
  contradiction, `errors.CheckpointError` for a directory whose config.json cannot be read or expressed."""
  derived = hf_config.derive_keys(path)
  merged = dict(config_lib.parse_overrides(hf_config.tokens(derived)))
  given = config_lib.parse_overrides(tokens)
  merged.update(given)
  keys = [f"{key}={value}" for key, value in merged.items()]
  cfg = config_lib.resolve_config(keys)
  hf_config.check_keys(cfg, path, derived)
  if cfg.decoder_block == "deepseek4" and "mtp_num_layers" not in given:
    refuse_v4_mtp(path)
  return keys, cfg


def refuse_v4_mtp(path: str) -> None:
  """Refuses a DeepSeek-V4 directory that stores an MTP block, naming its arrays and why, unless the user said
  `mtp_num_layers=0` (then the import leaves them out and its report lists them)."""
  mtp = hf_names_v4.mtp_tensors(safetensors_header.read_tensor_table(path))
  if mtp:
    blocks = sorted({".".join(name.split(".")[:2] if name.startswith("mtp.") else name.split(".")[:3])
                     for name in mtp})
    raise errors.ConfigError(
        f"{path} stores DeepSeek-V4's MTP block ({', '.join(blocks)}: {len(mtp)} tensors, e.g. {mtp[0]}): "
        f"{MTP_REASON}; accepted: mtp_num_layers=0 to import the main model without them (import_report.json "
        "then lists them as not imported)")
