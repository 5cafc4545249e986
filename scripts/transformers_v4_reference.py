"""Makes tests/data/v4/: DeepSeek-V4 and V3.1 directories made by transformers 5.24, and transformers' logits on them
and on our exports of them: the independent reader of issue 37.

Runs in a virtual environment with torch 2.13.0 (CPU), transformers 5.24, accelerate, safetensors, ml_dtypes
(Python 3.11; MaxText's stack has no torch, and CI cannot install it: the tests read what this writes):

  /work/venvs/hf/bin/python scripts/transformers_v4_reference.py sources tests/data/v4
      v4_saved/     a random DeepseekV4ForCausalLM (float32) as `save_pretrained` writes it: transformers' spelling
                    (`model.layers.*`, `layer_types` + `compress_rates`, `mlp_layer_types`, `rope_parameters`),
                    a schedule MaxText's scanned tree cannot hold (HCA at ratio 8), two hash-routed layers;
      v4_saved_bf16/ the same model saved in bfloat16 (transformers keeps its float32-only modules in float32);
      v4_release/   another one in DeepSeek-V4's release layout, written here from transformers' own tensors by an
                    independent numpy / ml_dtypes packer: routed experts FP4 (int8, two e2m1 values per byte, low
                    nibble first, one float8_e8m0fnu scale per 32 values), the other Linear weights FP8 (e4m3, one
                    e8m0 scale per 128x128 block, `.scale`), the compressors, router, norms and embeddings bf16,
                    mHC, sinks, `ape` and the gate bias float32, `tid2eid` int32, the release's names and config
                    (`compress_ratios` with its MTP layer's entry, `num_hash_layers`, `expert_dtype: fp4`,
                    `quantization_config.scale_fmt: ue8m0`) and an MTP block `mtp.0.*`; a scanned schedule;
      v31_ue8m0/    tests/data/import/hf_small (a transformers-made DeepSeek-V3) in DeepSeek-V3.1's layout: FP8 with
                    float32 `weight_scale_inv` that are powers of two, `scale_fmt: ue8m0`;
      tokens.npy, logits.npz (transformers' float32 logits of each directory, loaded by `from_pretrained` on the
      CPU: quantized weights dequantized by transformers' fine-grained FP8 integration; and of v4_release with the
      release's YaRN `rope_scaling` added, `release_yarn`), config_yarn.json, transformers_fp4_unpacking.npz
      (transformers' `Fp8Dequantize._dequantize_one` of every byte value in every scale);
  /work/venvs/hf/bin/python scripts/transformers_v4_reference.py exports tests/data/v4 NAME=DIR ...
      export_logits.npz: transformers' logits on each of our exports (made by tests/test_v4_hf.py's commands, see
      tests/data/README.md), and export_sha256.json: the sha256 of every file of each export it ran on.
"""

import hashlib
import json
import os
import shutil
import struct
import sys

import ml_dtypes
import numpy as np

TAGS = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(ml_dtypes.float8_e4m3fn):
        "F8_E4M3", np.dtype(np.int8): "I8", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}
E8M0 = "F8_E8M0"  # uint8 arrays written with this tag
SEED = 37
COMMON = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
              head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, hc_mult=4, hc_sinkhorn_iters=20, sliding_window=16,
              index_n_heads=16, index_head_dim=32, index_topk=4, routed_scaling_factor=1.5, swiglu_limit=10.0,
              rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=40000.0, tie_word_embeddings=False,
              max_position_embeddings=4096)


# ---------------------------------------------------------------------------------------------------------
# The formats, from their definitions (numpy + ml_dtypes; nothing of inspect_checkpoint).

def write_safetensors(path, tensors):
  """tensors: name -> array, or name -> (uint8 array, "F8_E8M0")."""
  header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
  for name in sorted(tensors):
    value = tensors[name]
    tag = value[1] if isinstance(value, tuple) else TAGS[value.dtype]
    array = np.ascontiguousarray(value[0] if isinstance(value, tuple) else value)
    header[name] = {"dtype": tag, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
    blobs.append(array.tobytes())
    offset += array.nbytes
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def pow2_at_least(x):
  """The smallest power of two >= x > 0 (frexp: x = m 2^e, m in [0.5, 1))."""
  mantissa, exponent = np.frexp(np.asarray(x, np.float64))
  return np.ldexp(1.0, np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)


def e8m0_bytes(pow2):
  return (np.frexp(pow2)[1] - 1 + 127).astype(np.uint8)


def fp8_blocks(w, power_of_two=True):
  """(e4m3 values, float32 scale per 128x128 block) of an (out, in) weight; a zero block gets scale 1."""
  rows, cols = w.shape
  grid = (-(-rows // 128), -(-cols // 128))
  scale = np.ones(grid, np.float32)
  q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
  for r in range(grid[0]):
    for c in range(grid[1]):
      tile = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
      amax = float(np.abs(tile).max())
      if amax > 0:
        scale[r, c] = pow2_at_least(amax / 448.0) if power_of_two else np.float32(amax / 448.0)
      q[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] = np.clip(tile / scale[r, c], -448, 448).astype(q.dtype)
  return q, scale


def fp4_groups(w):
  """(int8 packed e2m1 (out, in/2), uint8 e8m0 scale codes (out, in/32)) of an (out, in) weight."""
  rows, cols = w.shape
  groups = w.reshape(rows, cols // 32, 32)
  amax = np.abs(groups).max(-1)
  scale = np.where(amax > 0, pow2_at_least(np.maximum(amax, 1e-30) / 6.0), np.float32(1.0))
  codes = (groups / scale[..., None]).reshape(rows, cols).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
  return packed, e8m0_bytes(scale)


# ---------------------------------------------------------------------------------------------------------
# Models.

def _randomize(model, torch, rng):
  """transformers initializes sinks, ape, biases and mHC bases to zero, scales and norms to one and tid2eid to
  expert 0: give every tensor values that exercise it."""
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
        param.copy_(torch.tensor(rng.normal(0, 0.5, param.shape), dtype=param.dtype))
      elif name.endswith((".scale", "hc_scale")):
        param.copy_(torch.tensor(rng.uniform(0.5, 1.5, param.shape), dtype=param.dtype))
      elif "norm" in name and name.endswith("weight"):
        param.copy_(torch.tensor(rng.uniform(0.8, 1.2, param.shape), dtype=param.dtype))
    for name, buf in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buf.copy_(torch.tensor(rng.normal(0, 0.1, buf.shape), dtype=buf.dtype))
      elif name.endswith("tid2eid"):
        experts = model.config.n_routed_experts
        table = np.stack([rng.permutation(experts)[:buf.shape[1]] for _ in range(buf.shape[0])])
        buf.copy_(torch.tensor(table, dtype=buf.dtype))


def make_model(config_kwargs, seed):
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # pylint: disable=import-outside-toplevel

  torch.manual_seed(seed)
  model = DeepseekV4ForCausalLM(DeepseekV4Config(**config_kwargs)).eval()
  _randomize(model, torch, np.random.default_rng(seed))
  return model


def _hc_scales_checked(model, directory, missing, torch):
  """transformers 5.24's load report of a quantized V4 directory lists every layer's `attn_hc.scale` /
  `ffn_hc.scale` as MISSING (and `layers.N.{attn,ffn}_hc.weight` as UNEXPECTED: its FP8 quantizer's `.scale`
  rename meets the name the model's rename made of `hc_attn_scale`), yet the values are loaded: check them against
  the files and drop them from the missing list (any other missing weight stops the script)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  stored = {}
  for name in os.listdir(directory):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(directory, name), "pt") as f:
        stored |= {k.removeprefix("model."): f.get_tensor(k) for k in f.keys()
                   if k.endswith(("hc_attn_scale", "hc_ffn_scale"))}
  checked = []
  for key in missing:
    parts = key.split(".")  # model.layers.{i}.{attn,ffn}_hc.scale
    if len(parts) == 5 and parts[3] in ("attn_hc", "ffn_hc") and parts[4] == "scale":
      loaded = getattr(model.model.layers[int(parts[2])], parts[3]).scale.detach().float()
      if not torch.equal(loaded, stored[f"layers.{parts[2]}.hc_{parts[3][:-3]}_scale"].float()):
        raise SystemExit(f"{directory}: transformers did not load {key}")
      checked.append(key)
  return [key for key in missing if key not in checked]


def logits_of(directory, tokens, dtype="float32"):
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype),
                                                            output_loading_info=True)
  model, info = model
  missing = [m for m in info["missing_keys"] if not m.endswith("rotary_emb.inv_freq")]
  if missing and model.config.model_type == "deepseek_v4":
    missing = _hc_scales_checked(model, directory, missing, torch)
  if missing or info.get("mismatched_keys"):
    raise SystemExit(f"{directory}: transformers left weights unloaded: {missing[:5]} {info.get('mismatched_keys')}")
  with torch.no_grad():
    out = model(torch.tensor(tokens, dtype=torch.long)).logits
  unexpected = [k for k in info["unexpected_keys"] if not k.endswith(("attn_hc.weight", "ffn_hc.weight"))]
  return out.float().numpy(), sorted(unexpected)


def release_tensors(state, config):
  """The release layout of the tensors `save_pretrained` wrote (its names, `model.` dropped; numpy arrays)."""
  out = {}
  top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
         "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
         "model.hc_head.hc_scale": "hc_head_scale", "head.weight": "head.weight"}
  fp8 = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight", ".attn.wo_b.weight",
         ".attn.indexer.wq_b.weight", ".shared_experts.w1.weight", ".shared_experts.w2.weight",
         ".shared_experts.w3.weight")
  for name, value in state.items():
    value = value.astype(np.float32) if value.dtype.kind == "f" else value
    name = top.get(name) or (name[len("model."):] if name.startswith("model.") else name)
    if ".ffn.experts." in name:
      out[name], codes = fp4_groups(value)
      out[name[:-len("weight")] + "scale"] = (codes, E8M0)
    elif name.endswith(fp8):
      q, scale = fp8_blocks(value)
      out[name], out[name[:-len("weight")] + "scale"] = q, (e8m0_bytes(scale), E8M0)
    elif name.endswith("tid2eid"):
      out[name] = value.astype(np.int32)
    elif name.endswith(("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")):
      out[name] = value.astype(np.float32)
    else:
      out[name] = value.astype(ml_dtypes.bfloat16)
  return out


def mtp_block(config, rng):
  """A stand-in for the release's MTP block `mtp.0.*` (names as DeepSeek's; import must refuse or list it)."""
  e = config["hidden_size"]
  return {"mtp.0.e_proj.weight": rng.normal(0, 0.02, (e, e)).astype(ml_dtypes.bfloat16),
          "mtp.0.h_proj.weight": rng.normal(0, 0.02, (e, e)).astype(ml_dtypes.bfloat16),
          "mtp.0.enorm.weight": np.ones(e, ml_dtypes.bfloat16), "mtp.0.hnorm.weight": np.ones(e, ml_dtypes.bfloat16),
          "mtp.0.norm.weight": np.ones(e, ml_dtypes.bfloat16)}


def _release_config(config_kwargs, ratios, hash_layers):
  doc = {k: v for k, v in config_kwargs.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
  doc |= {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hidden_layers": len(ratios),
          "compress_ratios": ratios + [0], "num_hash_layers": hash_layers, "num_nextn_predict_layers": 1,
          "topk_method": "noaux_tc", "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "hidden_act": "silu",
          "expert_dtype": "fp4", "torch_dtype": "bfloat16",
          "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}
  return doc


def sources(out):
  import torch  # pylint: disable=import-outside-toplevel

  os.makedirs(out, exist_ok=True)
  rng = np.random.default_rng(SEED)
  tokens = rng.integers(0, COMMON["vocab_size"], (2, 272)).astype(np.int32)
  np.save(os.path.join(out, "tokens.npy"), tokens)
  logits = {}
  # 1. transformers' save_pretrained, float32, HCA at ratio 8 (unscannable), two hash layers.
  saved = dict(COMMON, num_hidden_layers=5, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                         "heavily_compressed_attention", "compressed_sparse_attention",
                                                         "heavily_compressed_attention"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
               mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"])
  model = make_model(saved, SEED)
  target = os.path.join(out, "v4_saved")
  shutil.rmtree(target, ignore_errors=True)
  model.save_pretrained(target)
  logits["saved"], _ = logits_of(target, tokens)
  target = os.path.join(out, "v4_saved_bf16")  # the same model saved in bfloat16 (its float32-only modules stay so)
  shutil.rmtree(target, ignore_errors=True)
  model.to(torch.bfloat16).save_pretrained(target)
  logits["saved_bf16"], _ = logits_of(target, tokens)
  # 2. the release layout, a scanned schedule (sliding hash layer, then HCA 128 / CSA 4 pairs), an MTP block.
  ratios, hashed = [0, 128, 4, 128, 4], 1
  release = dict(COMMON, num_hidden_layers=5, compress_ratios=ratios, num_hash_layers=hashed)
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

  model = make_model(release, SEED + 1)
  target = os.path.join(out, "v4_release")
  shutil.rmtree(target, ignore_errors=True)
  model.save_pretrained(target)
  state = load_file(os.path.join(target, "model.safetensors"))
  shutil.rmtree(target)
  os.makedirs(target)
  tensors = release_tensors(state, release) | mtp_block(release, rng)
  names = sorted(tensors)
  half = len(names) // 2
  index = {}
  for k, part in enumerate((names[:half], names[half:])):
    shard = f"model-0000{k + 1}-of-00002.safetensors"
    write_safetensors(os.path.join(target, shard), {n: tensors[n] for n in part})
    index |= {n: shard for n in part}
  with open(os.path.join(target, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
    json.dump({"metadata": {}, "weight_map": index}, f, indent=1)
  config = _release_config(release, ratios, hashed)
  with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=1)
  logits["release"], unexpected = logits_of(target, tokens)
  assert all(n.startswith("mtp.") for n in unexpected), unexpected  # transformers ignores the MTP block
  yarn = dict(config, rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                                    "beta_fast": 32, "beta_slow": 1})
  with open(os.path.join(out, "config_yarn.json"), "w", encoding="utf-8") as f:
    json.dump(yarn, f, indent=1)
  shutil.copy(os.path.join(target, "config.json"), os.path.join(out, "config_plain.json"))
  shutil.copy(os.path.join(out, "config_yarn.json"), os.path.join(target, "config.json"))
  logits["release_yarn"], _ = logits_of(target, tokens)
  shutil.copy(os.path.join(out, "config_plain.json"), os.path.join(target, "config.json"))
  os.remove(os.path.join(out, "config_plain.json"))
  # 3. DeepSeek-V3.1's layout of tests/data/import/hf_small.
  logits["v31"] = v31(os.path.join(os.path.dirname(os.path.abspath(out)), "import", "hf_small"),
                      os.path.join(out, "v31_ue8m0"), np.load(os.path.join(os.path.dirname(os.path.abspath(out)),
                                                                          "import", "tokens.npy")))
  np.savez_compressed(os.path.join(out, "logits.npz"), **logits)
  unpacking(out, torch)


def v31(src, target, tokens):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

  shutil.rmtree(target, ignore_errors=True)
  os.makedirs(target)
  for name in sorted(os.listdir(src)):
    if not name.endswith(".safetensors"):
      continue
    out = {}
    for key, value in load_file(os.path.join(src, name)).items():
      linear = key.startswith("model.layers.") and key.endswith("proj.weight") and ".eh_proj." not in key
      if linear or key.endswith("proj_with_mqa.weight"):
        out[key], out[key[:-len("weight")] + "weight_scale_inv"] = fp8_blocks(value)
      else:
        out[key] = value
    write_safetensors(os.path.join(target, name), out)
  with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
  with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=1)
  index = {}
  for name in sorted(os.listdir(target)):
    if name.endswith(".safetensors"):
      with open(os.path.join(target, name), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
      index |= {k: name for k in header if k != "__metadata__"}
  with open(os.path.join(target, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
    json.dump({"metadata": {}, "weight_map": index}, f, indent=1)
  return logits_of(target, tokens)[0]


def unpacking(out, torch):
  """transformers' own FP4 dequantization of every byte value under every scale code in 0..254."""
  from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # pylint: disable=import-outside-toplevel

  codes = np.arange(255, dtype=np.uint8)[:, None]  # one row per scale
  packed = np.tile(np.arange(256, dtype=np.uint8), (255, 1))  # 512 values per row: 16 groups of 32
  scales = np.repeat(codes, 16, axis=1)
  value = Fp8Dequantize(None)._dequantize_one(  # pylint: disable=protected-access
      torch.from_numpy(packed.view(np.int8)), torch.from_numpy(scales).view(torch.float8_e8m0fnu), torch.float32)
  np.savez_compressed(os.path.join(out, "transformers_fp4_unpacking.npz"), packed=packed.view(np.int8),
                      scale_codes=scales, transformers=value.numpy())


def exports(out, pairs):
  logits, hashes = {}, {}
  tokens = np.load(os.path.join(out, "tokens.npy"))
  for pair in pairs:
    name, directory = pair.split("=", 1)
    run_tokens = np.load(os.path.join(os.path.dirname(os.path.abspath(out)), "import", "tokens.npy")) \
        if name.startswith("v3") else tokens
    logits[name], _ = logits_of(directory, run_tokens)
    hashes[name] = {f: hashlib.sha256(open(os.path.join(directory, f), "rb").read()).hexdigest()
                    for f in sorted(os.listdir(directory)) if f.endswith((".safetensors", ".json"))
                    and f not in ("quantization_report.json", "export_manifest.json")}
  np.savez_compressed(os.path.join(out, "export_logits.npz"), **logits)
  with open(os.path.join(out, "export_sha256.json"), "w", encoding="utf-8") as f:
    json.dump(hashes, f, indent=1, sort_keys=True)


if __name__ == "__main__":
  if sys.argv[1] == "sources":
    sources(sys.argv[2])
  elif sys.argv[1] == "exports":
    exports(sys.argv[2], sys.argv[3:])
  else:
    raise SystemExit(__doc__)
