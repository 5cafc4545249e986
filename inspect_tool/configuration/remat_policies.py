"""MaxText 0.2.5's `remat_policy` names: which named activations of a scanned layer each policy keeps on the device
(`SAVED`) or moves to host memory (`OFFLOADED`), and `custom`'s per-name keys. Plain tables, so that the plan
(`sharding.activations`) reads them without JAX; `model.remat` builds the `jax.checkpoint` policies from them.
"""

from __future__ import annotations

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
