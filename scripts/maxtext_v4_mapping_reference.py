"""Makes tests/data/v4/maxtext_v4_mapping.json: MaxText 0.2.5's own DeepSeek-V4 conversion of tests/data/v4/v4_saved.

MaxText's V4 mapping (`checkpoint_conversion/utils/param_mapping.py`: DEEPSEEK_V4_MAXTEXT_TO_HF_PARAM_MAPPING and
DEEPSEEK_V4_MAXTEXT_TO_HF_PARAM_HOOK_FN, loading direction, unscanned) applied to the directory's float32 tensors
under the release's names (transformers' save_pretrained spelling undone: `model.` dropped, `model.embed_tokens` ->
`embed`, `model.hc_head.hc_fn` -> `hc_head_fn`, ...); for each MaxText array its shape and the sha256 of its float32
bytes (C order). MaxText names the attention's kv norm `attn.kv_norm.weight`; the release (and transformers'
save_pretrained) stores it as `attn.norm.weight`, which is served for it (listed under
`maxtext_name_not_in_release`). Runs with MaxText 0.2.5 installed (its venv; not the test environment):
  /work/venvs/maxtext/bin/python scripts/maxtext_v4_mapping_reference.py tests/data/v4/v4_saved KEYS_JSON OUT.json
KEYS_JSON: {"num_experts", "first_num_hash_layers", "compress_ratios", "base_num_decoder_layers"} (our derived keys;
the directory's config.json spells the schedule as transformers' `layer_types`, which MaxText's mapping does not read).
"""

import hashlib
import json
import os
import sys
import types

import numpy as np
from maxtext.checkpoint_conversion.utils import param_mapping
from safetensors.numpy import load_file

TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
       "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
       "model.hc_head.hc_scale": "hc_head_scale", "head.weight": "head.weight"}


def main(directory, keys_path, out):
  tensors = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      for key, value in load_file(os.path.join(directory, name)).items():
        tensors[TOP.get(key) or key.removeprefix("model.")] = value
  with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  with open(keys_path, encoding="utf-8") as f:
    keys = json.load(f)
  maxtext = types.SimpleNamespace(**keys)
  config = {k: v for k, v in config.items() if k not in ("compress_ratios", "num_hash_layers")}
  mapping = param_mapping.DEEPSEEK_V4_MAXTEXT_TO_HF_PARAM_MAPPING(config, maxtext, scan_layers=False)
  hooks = param_mapping.DEEPSEEK_V4_MAXTEXT_TO_HF_PARAM_HOOK_FN(config, maxtext, scan_layers=False,
                                                                saving_to_hf=False)
  result, renamed = {}, {}

  def tensor(name):
    """MaxText's name of a release tensor; where the release names it otherwise (recorded), the release's."""
    if name in tensors:
      return tensors[name]
    release = name.replace(".attn.kv_norm.", ".attn.norm.")
    renamed[name] = release
    return tensors[release]

  for key, hf in mapping.items():
    hook = hooks.get(key)
    if hf is None:  # mhc_norm: no HF tensor, MaxText's hook makes ones
      shape = (keys["mhc_expansion_rate"] * keys["base_emb_dim"],)
      value = hook(None, shape)
    elif isinstance(hf, list):  # routed experts: one HF tensor per expert, stacked on axis 0
      parts = [tensor(name) for name in hf]
      value = np.stack([hook(p, p.T.shape) if hook else p for p in parts])
    else:
      value = tensor(hf)
      if hook is not None:
        value = hook(value, _target_shape(key, value, keys))
    value = np.ascontiguousarray(np.asarray(value, np.float32))
    result[key] = {"shape": list(value.shape), "sha256": hashlib.sha256(value.tobytes()).hexdigest()}
  with open(out, "w", encoding="utf-8") as f:
    json.dump({"arrays": result, "maxtext_name_not_in_release": renamed}, f, indent=1, sort_keys=True)


def _target_shape(key, value, keys):
  """The MaxText shape a hook reshapes to (what MaxText's converter passes it from the model's tree)."""
  e, h, d = keys["base_emb_dim"], keys["base_num_query_heads"], keys["head_dim"]
  g, o = keys["o_groups"], keys["o_lora_rank"]
  if key.endswith("o_a_proj-kernel"):
    return (g, h * d // g, o)
  if key.endswith("wq_b-kernel"):
    return (keys["q_lora_rank"], h, d)
  if key.endswith("wkv-kernel"):
    return (e, 1, d)
  if key.endswith("token_embedder-embedding"):
    return value.shape
  if key.endswith("logits_dense-kernel"):
    return (e, keys["vocab_size"])
  return value.T.shape


if __name__ == "__main__":
  main(*sys.argv[1:4])
