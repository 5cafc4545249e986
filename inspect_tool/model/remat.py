"""MaxText 0.2.5's `remat_policy` for a scanned layer stack: which named activations the backward pass keeps.

The layers name their activations as MaxText's do (`jax.ad_checkpoint.checkpoint_name`: `decoder_layer_input`,
MLA's `query_wa_proj`, `mla_q`, `kv_wa_proj`, `mla_kv`, `query_proj`, `key_proj`, `value_proj`, `attention_out`,
`out_proj`; the MLPs' `mlpwi_0`, `mlpwi_1`, `mlpwo`, the routed experts' `moe_mlpwi_0`, `moe_mlpwi_1`,
`moe_mlpwo`; splash attention's residuals `context`); `policy(cfg)` is the `jax.checkpoint` policy MaxText's
`get_remat_policy` builds from them: `full` saves nothing but the layer input (the scan's carry), `minimal` the
projections and MLP outputs, the `*_offloaded` ones move theirs to host memory, `custom` saves (`device`) or offloads
(`offload`) each name its key sets. `none` (no `jax.checkpoint` at all) keeps every residual. The policies' names are
`configuration.remat_policies`.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from inspect_tool.configuration import remat_policies


def policy(name: str, cfg=None):
  """The `jax.checkpoint` policy of `remat_policy=name` (None for `full`: nothing saved)."""
  if name in remat_policies.SAVED:
    return jax.checkpoint_policies.save_only_these_names(*remat_policies.SAVED[name])
  if name in remat_policies.OFFLOADED or name == "custom":
    keep, offload = (remat_policies.custom_names(cfg) if name == "custom"
                     else ((), remat_policies.OFFLOADED[name]))
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(keep), names_which_can_be_offloaded=list(offload), offload_src="device",
        offload_dst="pinned_host")
  return None


def name(x, *names: str):
  """`x` tagged with each of `names` (MaxText tags some values twice: `mlpwi_0` and `moe_mlpwi_0`)."""
  for n in names:
    x = checkpoint_name(x, n)
  return x
