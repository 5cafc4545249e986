"""Makes tests/data/transformers_rope.json: how transformers reads the rope of our deepseek-fp8 config.json.

Two steps, in two environments (MaxText's stack has no torch):
  .venv-py3.12/bin/python scripts/transformers_rope_reference.py configs build/rope_configs.json
      writes, for each case of `CASES` (MaxText keys), the config.json `write_hf.hf_config` gives;
  <venv with torch 2.13.0 and transformers 5.24.0>/bin/python scripts/transformers_rope_reference.py read \
      build/rope_configs.json tests/data/transformers_rope.json
      adds what transformers computes from each: YaRN's inverse frequencies and cos/sin factor
      (`ROPE_INIT_FUNCTIONS["yarn"]`), the attention's softmax scale (`DeepseekV3Attention.scaling`), and the
      rope parameters and max_position_embeddings its config ends with.
"""

import copy
import json
import sys

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=0", "override_model_config=true", "base_num_decoder_layers=2",
        "first_num_dense_layers=1", "vocab_size=256"]
CASES = {
    "preset (context extended 163840 / 4096, factor 40)": [],
    "max_position_embeddings 4096 = original": ["max_position_embeddings=4096"],
    "max_position_embeddings 2048 < original": ["max_position_embeddings=2048"],
    "max_position_embeddings 8192, factor 40 (ratio 2)": ["max_position_embeddings=8192"],
    "max_position_embeddings 65536, original 2048, factor 32 (ratio 32)": [
        "max_position_embeddings=65536", "original_max_position_embeddings=2048", "rope_factor=32"],
    "original 8192 > max_position_embeddings 4096, factor 4": [
        "max_position_embeddings=4096", "original_max_position_embeddings=8192", "rope_factor=4"],
    "mscale 0.707, no truncation, factor 16": ["mscale=0.707", "rope_truncate=false", "rope_factor=16"],
    "factor 1": ["rope_factor=1", "max_position_embeddings=4096"],
    "rope_attention_scaling": ["rope_attention_scaling=true"],
    "rope_attention_scaling, not extended": ["rope_attention_scaling=true", "max_position_embeddings=4096"],
    "rope_max_timescale 50000, beta 16/2": ["rope_max_timescale=50000", "beta_fast=16", "beta_slow=2"],
}


def write_configs(out: str) -> None:
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import write_hf  # pylint: disable=import-outside-toplevel

  docs = {name: {"keys": keys, "config": write_hf.hf_config(config.resolve_config(TINY + keys))}
          for name, keys in CASES.items()}
  with open(out, "w", encoding="utf-8") as f:
    json.dump(docs, f, indent=1)


def read_configs(src: str, out: str) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # pylint: disable=import-outside-toplevel
  from transformers.models.deepseek_v3 import modeling_deepseek_v3  # pylint: disable=import-outside-toplevel

  with open(src, encoding="utf-8") as f:
    docs = json.load(f)
  for case in docs.values():
    doc = copy.deepcopy({k: v for k, v in case["config"].items() if k not in ("architectures", "quantization_config")})
    cfg = transformers.DeepseekV3Config(**doc)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, torch.device("cpu"))
    case["transformers"] = {
        "version": transformers.__version__, "inv_freq": inv_freq.double().tolist(),
        "attention_factor": float(attention_factor),
        "softmax_scale": float(modeling_deepseek_v3.DeepseekV3Attention(cfg, 0).scaling),
        "rope_parameters": dict(cfg.rope_parameters), "max_position_embeddings": cfg.max_position_embeddings}
  with open(out, "w", encoding="utf-8") as f:
    json.dump(docs, f, indent=1)
    f.write("\n")


if __name__ == "__main__":
  if sys.argv[1] == "configs":
    write_configs(sys.argv[2])
  else:
    read_configs(sys.argv[2], sys.argv[3])
