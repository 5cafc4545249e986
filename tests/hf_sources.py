"""Hugging Face DeepSeek-V3-shaped (and V4 release) directories for import tests and benchmarks, written from the safetensors format's
definition (`test_import.write_safetensors`), one shard per layer, never more than one layer in memory."""

from __future__ import annotations

import json
import os

import ml_dtypes
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


def write_v4_release_dir(root: str, emb: int, moe_mlp: int, experts: int, vocab: int, seed: int = 0) -> int:
  """A one-layer DeepSeek-V4 directory in its release layout (FP4 routed experts: random e2m1 bytes with e8m0 scales
  around 2^-6; FP8 with e8m0 128x128 blocks; bf16 / float32 rest; the layer hash-routed, sliding window only), one
  shard per routed matrix kind so no more than one expert stack is in memory; returns its bytes."""
  rng = np.random.default_rng(seed)
  heads, head_dim, q_lora, groups, o_lora, k = 4, 64, 64, 2, 64, 4

  def bf16(*shape):
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

  def fp8(name, rows, cols):  # e4m3 bytes of magnitude < 1 (no NaN byte), scale 2^-7 per 128x128 block
    codes = rng.integers(0, 0x38, (rows, cols), dtype=np.uint8) | (rng.integers(0, 2, (rows, cols), np.uint8) << 7)
    grid = (-(-rows // 128), -(-cols // 128))
    return {name + ".weight": codes.view(ml_dtypes.float8_e4m3fn),
            name + ".scale": np.full(grid, 127 - 7, np.uint8).view(ml_dtypes.float8_e8m0fnu)}

  p = "layers.0."
  top = {"embed.weight": bf16(vocab, emb), "head.weight": bf16(vocab, emb), "norm.weight": np.ones(emb, ml_dtypes.bfloat16),
         "hc_head_fn": np.asarray(bf16(k, k * emb), np.float32), "hc_head_base": np.zeros(k, np.float32),
         "hc_head_scale": np.ones(1, np.float32),
         p + "attn_norm.weight": np.ones(emb, ml_dtypes.bfloat16), p + "ffn_norm.weight": np.ones(emb, ml_dtypes.bfloat16),
         p + "attn.q_norm.weight": np.ones(q_lora, ml_dtypes.bfloat16),
         p + "attn.norm.weight": np.ones(head_dim, ml_dtypes.bfloat16),
         p + "attn.attn_sink": np.zeros(heads, np.float32), p + "ffn.gate.weight": bf16(experts, emb),
         p + "ffn.gate.tid2eid": np.stack([rng.permutation(experts)[:2] for _ in range(vocab)]).astype(np.int32)}
  for hc in ("hc_attn", "hc_ffn"):
    top |= {p + f"{hc}_fn": np.asarray(bf16((2 + k) * k, k * emb), np.float32),
            p + f"{hc}_base": np.zeros((2 + k) * k, np.float32), p + f"{hc}_scale": np.ones(3, np.float32)}
  for name, rows, cols in (("attn.wq_a", q_lora, emb), ("attn.wq_b", heads * head_dim, q_lora),
                           ("attn.wkv", head_dim, emb), ("attn.wo_a", groups * o_lora, heads * head_dim // groups),
                           ("attn.wo_b", emb, groups * o_lora), ("ffn.shared_experts.w1", moe_mlp, emb),
                           ("ffn.shared_experts.w3", moe_mlp, emb), ("ffn.shared_experts.w2", emb, moe_mlp)):
    top |= fp8(p + name, rows, cols)
  write_safetensors(os.path.join(root, "model-top.safetensors"), top)
  total = sum(v.nbytes for v in top.values())
  for w, (rows, cols) in (("w1", (moe_mlp, emb)), ("w3", (moe_mlp, emb)), ("w2", (emb, moe_mlp))):
    part = {}
    for j in range(experts):
      part[p + f"ffn.experts.{j}.{w}.weight"] = rng.integers(-128, 128, (rows, cols // 2), dtype=np.int8)
      part[p + f"ffn.experts.{j}.{w}.scale"] = np.full((rows, cols // 32), 127 - 6, np.uint8).view(
          ml_dtypes.float8_e8m0fnu)
    write_safetensors(os.path.join(root, f"model-experts-{w}.safetensors"), part)
    total += sum(v.nbytes for v in part.values())
  config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": vocab,
            "hidden_size": emb, "moe_intermediate_size": moe_mlp, "num_hidden_layers": 1,
            "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": head_dim, "qk_rope_head_dim": 16,
            "q_lora_rank": q_lora, "o_groups": groups, "o_lora_rank": o_lora, "n_routed_experts": experts,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "compress_ratios": [0, 0], "num_hash_layers": 1,
            "sliding_window": 16, "hc_mult": k, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 8,
            "expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                           "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                                                           "weight_block_size": [128, 128]}}
  with open(os.path.join(root, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=1)
  return total
