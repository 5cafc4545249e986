"""Import's inputs, checked before any work: the keys of the directory and the user's, the config, the budget.

Light on purpose (no JAX, no model): the CLI checks them before joining a multi-process job, so that a bad input
ends in one line and no other process, and before the import's own modules are loaded, so that the budget's floor
(`streaming.budget.check_floor`: what the process already holds) is the same small figure on every host.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from inspect_tool import errors
from inspect_tool.configuration import config as config_lib
from inspect_tool.hf_import import keys as keys_lib
from inspect_tool.storage import paths
from inspect_tool.streaming import budget

SUPPORTED = "DeepSeek-V2, V3, V3.2 (decoder_block=deepseek) and V4 (decoder_block=deepseek4) layouts"


@dataclasses.dataclass(frozen=True)
class Inputs:
  """An import's inputs, resolved once (the CLI's, handed to the pipeline): the directory (absolute), the MaxText
  keys and the config they make, the budget in bytes."""
  path: str
  keys: list[str]
  cfg: config_lib.ModelConfig
  max_memory: int


def check_inputs(path: str, tokens: Sequence[str] = (), max_memory: int | None = None) -> Inputs:
  """An import's `Inputs`, every input checked, the budget above what the process holds.

  Raises:
    errors.InputError: the directory, a key or the budget is not acceptable.
  """
  resolved = resolve_inputs(path, tokens, max_memory)
  budget.check_floor(resolved.max_memory)
  return resolved


def resolve_inputs(path: str, tokens: Sequence[str] = (), max_memory: int | None = None) -> Inputs:
  """`check_inputs` less the floor: the import itself, once its modules are loaded, refuses a budget too small for
  its smallest read with the figure that works (`streaming.write_orbax.plan_jobs`)."""
  path = paths.absolute(path)
  keys, cfg = keys_lib.maxtext_keys(path, list(tokens))
  _check_supported(cfg)
  return Inputs(path, keys, cfg, budget.resolve_max_memory(max_memory))


def _check_supported(cfg) -> None:
  if cfg.decoder_block not in ("deepseek", "deepseek4"):
    raise errors.ConfigError(f"import reads {SUPPORTED}; model {cfg.model_name!r} (decoder_block="
                             f"{cfg.decoder_block}) has no Hugging Face DeepSeek layout here")
