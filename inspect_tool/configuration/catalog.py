"""What can be configured, as rows: the model presets and MaxText's keys (`inspect_checkpoint presets` / `keys`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from inspect_tool import errors
from inspect_tool.configuration import config, maxtext_keys, presets
from quant import safe_regex


@dataclasses.dataclass(frozen=True)
class PresetRow:
  """One preset as MaxText's model file sets it (`mtp_num_layers` as the file leaves it)."""

  name: str
  decoder_block: str
  attention_type: str
  description: str  # '' when the preset does not build as given (`note` says why)
  mtp: bool  # whether mtp_num_layers=1 is accepted with it
  parameters: int | None  # nnx.Params of the abstract model; None when not counted or not built
  note: str


def _description(cfg: config.ModelConfig) -> str:
  moe = (f"{cfg.num_experts} experts ({cfg.num_experts_per_tok} active, {cfg.shared_experts} shared)"
         if cfg.num_experts > 1 else "dense MLP")
  extras = [text for on, text in ((cfg.use_indexer, "sparse-attention indexer"),
                                  (cfg.mhc_expansion_rate > 1, f"{cfg.mhc_expansion_rate} hyper-connection streams"),
                                  (bool(cfg.compress_ratios), "compressed attention"),
                                  (cfg.first_num_hash_layers > 0, f"{cfg.first_num_hash_layers} hash-routed layers"))
            if on]
  return ", ".join([f"{cfg.num_decoder_layers} layers ({cfg.first_num_dense_layers} dense)", moe,
                    f"d_model {cfg.emb_dim}", f"vocab {cfg.vocab_size}", *extras])


def preset_rows(count_parameters: Callable[[config.ModelConfig], int] | None = None) -> list[PresetRow]:
  """Every preset, sorted by name; its parameters counted by `count_parameters` (e.g.
  `paramtree.params.parameter_count`: the abstract model, JAX, no memory), or left unknown without it."""
  rows = []
  for name in presets.names():
    try:
      cfg = config.resolve_config([f"model_name={name}"])
    except errors.InspectError as e:
      raw = presets.load(name)
      rows.append(PresetRow(name, raw.get("decoder_block"), raw.get("attention_type"), "", False, None,
                            f"does not build as given: {e}"))
      continue
    try:
      config.resolve_config([f"model_name={name}", "mtp_num_layers=1", "override_model_config=true"])
      mtp, note = True, ""
    except errors.InspectError as e:
      mtp, note = False, f"no MTP: {e}"
    rows.append(PresetRow(name, cfg.decoder_block, cfg.attention_type, _description(cfg), mtp,
                          count_parameters(cfg) if count_parameters else None, note))
  return rows


@dataclasses.dataclass(frozen=True)
class KeyRow:
  key: str
  default: Any  # the value used when the key is not given
  affects: str  # a `maxtext_keys.AFFECTS` kind
  note: str  # why (ignored / refused keys), and MaxText's default where this tool's differs


def key_rows(pattern: str | None = None) -> list[KeyRow]:
  """Every key `key=value` accepts (MaxText 0.2.5's and this tool's), sorted; `pattern` a regex searched in names."""
  matcher = None
  if pattern:
    try:
      matcher = safe_regex.check(pattern)
    except ValueError as e:
      raise errors.InputError(f"PATTERN {errors.shown(pattern)}: {e}; a plain part of a key name works too") from None
  maxtext = maxtext_keys.defaults()
  rows = []
  for key in sorted({*config.known_keys(), "model_file"}):
    if key == "passthrough" or (matcher is not None and not matcher.search(key)):
      continue
    if key == "model_file":  # read by `config.resolve_config` itself, not a field
      rows.append(KeyRow(key, None, "tree", "a YAML file of model keys used in place of a preset; this tool's key "
                         "(not in MaxText's base.yml)"))
      continue
    field = config.FIELDS.get(key)
    default = field.default if field is not None else maxtext[key]
    if field is not None and key in maxtext and maxtext[key] is not None:
      try:
        differs = config.parse_value(key, maxtext[key]) != default
      except errors.InspectError:
        differs = True
    else:
      differs = field is not None and key in maxtext and maxtext[key] != default
    kind, why = maxtext_keys.affects(key, config.FIELDS)
    notes = [why] if why else []
    if differs:
      notes.append(f"MaxText's default: {show(maxtext[key])}")
    if key not in maxtext:
      notes.append("this tool's key (not in MaxText's base.yml)")
    rows.append(KeyRow(key, list(default) if isinstance(default, tuple) else default, kind, "; ".join(notes)))
  return rows


def show(value: Any) -> str:
  """A default as MaxText's base.yml writes it (true, '', None, [a, b])."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if value is None:
    return "None"
  if isinstance(value, str):
    return value if value else "''"
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(show(v) for v in value) + "]"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
  return str(value)
