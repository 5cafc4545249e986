"""Hugging Face DeepSeek-V3-shaped directories for import tests and benchmarks, written from the safetensors format's
definition (`test_import.write_safetensors`), one shard per layer, never more than one layer in memory."""

from __future__ import annotations

import json
import os

import numpy as np

from test_import import write_safetensors


def write_hf_dir(root: str, emb: int, moe_mlp: int, mlp: int, experts: int, layers: int, vocab: int,
                 dtype=np.float16, seed: int = 0) -> int:
  """Writes the directory (random weights ~N(0, 0.02), unit norms, a random routing bias); returns its bytes."""
  rng = np.random.default_rng(seed)

  def tensor(*shape):
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)

  def ones(n):
    return np.ones(n, dtype)

  total = 0
  top = {"model.embed_tokens.weight": tensor(vocab, emb), "lm_head.weight": tensor(vocab, emb),
         "model.norm.weight": ones(emb)}
  write_safetensors(os.path.join(root, "model-top.safetensors"), top)
  total += sum(v.nbytes for v in top.values())
  for i in range(layers):
    p = f"model.layers.{i}."
    layer = {p + "input_layernorm.weight": ones(emb), p + "post_attention_layernorm.weight": ones(emb),
             p + "self_attn.q_a_proj.weight": tensor(64, emb), p + "self_attn.q_a_layernorm.weight": ones(64),
             p + "self_attn.q_b_proj.weight": tensor(4 * 48, 64),
             p + "self_attn.kv_a_proj_with_mqa.weight": tensor(32 + 16, emb),
             p + "self_attn.kv_a_layernorm.weight": ones(32), p + "self_attn.kv_b_proj.weight": tensor(4 * 64, 32),
             p + "self_attn.o_proj.weight": tensor(emb, 4 * 32)}
    if i == 0:
      layer.update({p + "mlp.gate_proj.weight": tensor(mlp, emb), p + "mlp.up_proj.weight": tensor(mlp, emb),
                    p + "mlp.down_proj.weight": tensor(emb, mlp)})
    else:
      layer.update({p + "mlp.gate.weight": tensor(experts, emb),
                    p + "mlp.gate.e_score_correction_bias": rng.standard_normal(experts, np.float32)})
      for name, shape in (("gate_proj", (moe_mlp, emb)), ("up_proj", (moe_mlp, emb)), ("down_proj", (emb, moe_mlp))):
        layer[p + f"mlp.shared_experts.{name}.weight"] = tensor(*shape)
        for j in range(experts):
          layer[p + f"mlp.experts.{j}.{name}.weight"] = tensor(*shape)
    write_safetensors(os.path.join(root, f"model-layer{i:03d}.safetensors"), layer)
    total += sum(v.nbytes for v in layer.values())
  with open(os.path.join(root, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config_json(emb, moe_mlp, mlp, experts, layers, vocab), f, indent=1)
  return total


def config_json(emb: int, moe_mlp: int, mlp: int, experts: int, layers: int, vocab: int) -> dict:
  """config.json of that directory, as transformers writes a DeepseekV3 one."""
  return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": emb,
          "intermediate_size": mlp, "moe_intermediate_size": moe_mlp, "n_routed_experts": experts,
          "n_shared_experts": 1, "num_experts_per_tok": 2, "num_hidden_layers": layers, "first_k_dense_replace": 1,
          "vocab_size": vocab, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
          "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_group": 1,
          "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
          "topk_method": "noaux_tc", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 163840,
          "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
          "rope_interleave": True, "tie_word_embeddings": False, "hidden_act": "silu",
          "num_nextn_predict_layers": 0, "attention_bias": False, "torch_dtype": "float16"}
