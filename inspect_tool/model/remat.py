"""MaxText 0.2.5's `remat_policy` for a scanned layer stack: which named activations the backward pass keeps.

The layers name their activations as MaxText's do (`jax.ad_checkpoint.checkpoint_name`: `decoder_layer_input`,
MLA's `query_wa_proj`, `mla_q`, `kv_wa_proj`, `mla_kv`, `query_proj`, `key_proj`, `value_proj`, `attention_out`,
`out_proj`; the MLPs' `mlpwi_0`, `mlpwi_1`, `mlpwo`, the routed experts' `moe_mlpwi_0`, `moe_mlpwi_1`,
`moe_mlpwo`; splash attention's residuals `context`); `policy(cfg)` is the `jax.checkpoint` policy MaxText's
`get_remat_policy` builds from them: `full` saves nothing but the layer input (the scan's carry), `minimal` the
projections and MLP outputs, the `*_offloaded` ones move theirs to host memory, `custom` saves (`device`) or offloads
(`offload`) each name its key sets. `none` (no `jax.checkpoint` at all) keeps every residual.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

_QKV = ("query_proj", "value_proj", "key_proj", "kv_proj", "qkv_proj")
_MINIMAL = _QKV + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
SAVED = {  # policy -> the names it saves on the device
    "minimal": _MINIMAL,
    "minimal_with_context": _MINIMAL + ("context",),
    "minimal_flash": _MINIMAL + ("context",),
    "save_dot_with_context_except_mlp": _QKV + ("context", "out_proj"),
    "save_dot_except_mlpwi": _QKV + ("out_proj", "mlpwo"),
    "save_dot_except_mlp": _QKV + ("out_proj",),
    "save_qkv_proj": _QKV,
    "save_out_proj": ("out_proj",),
}
OFFLOADED = {  # policy -> the names it moves to host memory
    "qkv_proj_offloaded": ("query_proj", "value_proj", "key_proj", "kv_proj"),
    "minimal_offloaded": _MINIMAL,
}
CUSTOM_NAMES = ("decoder_layer_input", "context", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0",
                "moe_mlpwi_1", "moe_mlpwo", "query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj",
                "out_proj", "query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "attention_out")
POLICIES = ("full", "none", "custom") + tuple(SAVED) + tuple(OFFLOADED)


def custom_names(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(names kept on the device, names offloaded) of `remat_policy=custom`: each name's key, `device` or `offload`
  (MaxText's `tensors_on_device` / `tensors_to_offload`)."""
  keep, offload = [], []
  for name in CUSTOM_NAMES:
    where = str(getattr(cfg, name, "remat"))
    (keep if where == "device" else offload if where == "offload" else []).append(name)
  return tuple(keep), tuple(offload)


def policy(name: str, cfg=None):
  """The `jax.checkpoint` policy of `remat_policy=name` (None for `full`: nothing saved)."""
  if name in SAVED:
    return jax.checkpoint_policies.save_only_these_names(*SAVED[name])
  if name in OFFLOADED or name == "custom":
    keep, offload = custom_names(cfg) if name == "custom" else ((), OFFLOADED[name])
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(keep), names_which_can_be_offloaded=list(offload), offload_src="device",
        offload_dst="pinned_host")
  return None


def name(x, *names: str):
  """`x` tagged with each of `names` (MaxText tags some values twice: `mlpwi_0` and `moe_mlpwi_0`)."""
  for n in names:
    x = checkpoint_name(x, n)
  return x
