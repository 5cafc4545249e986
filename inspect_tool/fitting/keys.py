"""`diff`'s fix: the command under which model and checkpoint agree, re-checked before it is printed.

The keys come from the checkpoint: for a Hugging Face directory the whole key set of its `config.json`
(`hf_config.derive_keys`), for an Orbax checkpoint every size key its shapes show (`infer_keys`), then the
suggestions of the recognised causes (weight dtype, quantization of an FP8 export). The given tokens keep their
order with the new values in place; `override_model_config=true` is added when a preset's key changes. The
command is run (`compare`, the same comparison `diff` made) and printed only if it agrees.
"""

from __future__ import annotations

import shlex
from typing import Any, Callable, Sequence

from inspect_tool import errors
from inspect_tool.hf import config as hf_config
from inspect_tool.checkpoint import infer_keys
from inspect_tool.checkpoint import locate
from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.configuration import config as config_lib

_ROUNDS = 3


def merge(tokens: Sequence[str], changes: dict[str, str]) -> list[str]:
  """`tokens` with `changes` (key -> raw value) applied in place and new keys appended."""
  out, seen = [], set()
  for token in tokens:
    key, sep, _ = token.partition("=")
    key = key.strip()
    if sep and key in changes:
      out.append(f"{key}={changes[key]}")
      seen.add(key)
    else:
      out.append(token)
  out += [f"{key}={value}" for key, value in changes.items() if key not in seen]
  return _with_override(out, changes)


def _with_override(tokens: list[str], changes: dict[str, str]) -> list[str]:
  raw = config_lib.parse_overrides(t for t in tokens if "=" in t)
  if config_lib.parse_value("override_model_config", raw.get("override_model_config", "false")):
    return tokens
  try:
    preset = config_lib.model_keys(raw.get("model_name", "default"), raw.get("model_file"))
  except errors.InspectError:
    return tokens
  typed = {k: config_lib.parse_value(k, v) if k in config_lib.FIELDS else v for k, v in changes.items()}
  if not any(k in preset and k != "model_name" and preset[k] != v for k, v in typed.items()):
    return tokens
  at = next((i + 1 for i, t in enumerate(tokens) if t.startswith("model_name=")), 0)
  return tokens[:at] + ["override_model_config=true"] + tokens[at:]


def _values(keys: dict[str, Any]) -> dict[str, str]:
  return {k: hf_config.format_value(v) for k, v in keys.items()}


def _suggestions(result) -> dict[str, str]:
  out = {}
  for cause in result.causes:
    for token in cause.suggestion.split():
      key, sep, value = token.partition("=")
      if sep and key in config_lib.FIELDS:
        out[key] = value
  return out


def _hf_candidates(tokens: Sequence[str], path: str) -> list[list[str]]:
  keys = hf_config.derive_keys(path)
  derived = _values(keys)
  given = config_lib.parse_overrides(t for t in tokens if "=" in t)
  extra = [t for t in tokens if "=" in t and t.partition("=")[0].strip() not in derived]
  first = hf_config.tokens(keys) + extra
  candidates = [first, hf_config.tokens(keys)]
  if "model_name" in given:  # the user's preset, when it builds the same model under the derived keys
    candidates.insert(0, merge(tokens, {k: v for k, v in derived.items() if k != "model_name"}))
  return candidates


def _orbax_candidates(tokens: Sequence[str], path: str) -> list[list[str]]:
  leaves = orbax_metadata.read_leaves(locate.resolve_orbax_path(path).items_dir)
  cfg = config_lib.resolve_config(tokens)
  return [merge(tokens, _values(infer_keys.changed(cfg, infer_keys.infer(leaves))))]


def suggest(tokens: Sequence[str], path: str, result, compare: Callable, hf: bool) -> str:
  """The command (one line) under which `compare(tokens, path)` agrees, or "" when none is found."""
  if result.agree:
    return ""
  try:
    candidates = _hf_candidates(tokens, path) if hf else _orbax_candidates(tokens, path)
  except errors.InspectError:
    return ""
  for candidate in candidates:
    for _ in range(_ROUNDS):
      try:
        _, outcome = compare(candidate, path)
      except errors.InspectError:
        break
      if outcome.agree:
        return shlex.join(["inspect_checkpoint", "diff", *candidate, "--path", path])
      more = {k: v for k, v in _suggestions(outcome).items() if f"{k}={v}" not in candidate}
      if not more:
        break
      candidate = merge(candidate, more)
  return ""
