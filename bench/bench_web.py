"""Benchmarks the header-only commands on a release served over HTTP: bytes moved and time, beside the files' size.

Source: a DeepSeek-V3-671B-shaped FP8 release (DeepSeek's names and shapes: 61 layers and the MTP layer, 256 routed
experts, float8 weights with a float32 `weight_scale_inv` per 128×128 block, bf16 embedding, head and norms) cut into
163 shards as the release is, written as sparse files (headers real, tensor data holes: ~690 GB apparent, a few MB
on disk), with `model.safetensors.index.json` and a `config.json` of DeepSeek-V3's keys. Served on 127.0.0.1 by the
test server (`tests/web_server.py`: honours byte ranges, counts the bytes it sends). Cases, each a process of its own,
wall time from the process:
  * `hf --summary` and `hf --keys` from the local directory (the peer: what reading the headers costs on disk);
  * the same over http:// (the bytes served counted by the server, beside the release's size).

  .venv-py3.12/bin/python bench/bench_web.py [--dir /tmp] [--tiny]

`--tiny` (a smoke run): 4 layers, 8 experts, 8 shards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import hf_sources  # noqa: E402  pylint: disable=wrong-import-position
from web_server import WebServer  # noqa: E402  pylint: disable=wrong-import-position

BITS = {"F8_E4M3": 8, "BF16": 16, "F32": 32}
BLOCK = 128


def _shape(full: bool) -> dict:
  if full:  # DeepSeek-V3 671B
    return dict(emb=7168, heads=128, q_rank=1536, kv_rank=512, nope=128, rope=64, v=128, mlp=18432, moe=2048,
                experts=256, layers=61, dense=3, vocab=129280, shards=163)
  return dict(emb=256, heads=4, q_rank=64, kv_rank=32, nope=32, rope=16, v=32, mlp=512, moe=128, experts=8,
              layers=4, dense=1, vocab=1024, shards=8)


def _tensors(s: dict) -> list[tuple[str, str, list[int]]]:
  """(name, dtype, shape) of every tensor of the release, in the order the release stores them (layer by layer)."""
  out = [("model.embed_tokens.weight", "BF16", [s["vocab"], s["emb"]])]

  def linear(name, rows, cols):
    out.append((name + ".weight", "F8_E4M3", [rows, cols]))
    out.append((name + ".weight_scale_inv", "F32", [math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)]))

  for i in range(s["layers"] + 1):  # the last one: the MTP (nextn) layer
    p = f"model.layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
      out.append((p + norm + ".weight", "BF16", [s["emb"]]))
    linear(p + "self_attn.q_a_proj", s["q_rank"], s["emb"])
    out.append((p + "self_attn.q_a_layernorm.weight", "BF16", [s["q_rank"]]))
    linear(p + "self_attn.q_b_proj", s["heads"] * (s["nope"] + s["rope"]), s["q_rank"])
    linear(p + "self_attn.kv_a_proj_with_mqa", s["kv_rank"] + s["rope"], s["emb"])
    out.append((p + "self_attn.kv_a_layernorm.weight", "BF16", [s["kv_rank"]]))
    linear(p + "self_attn.kv_b_proj", s["heads"] * (s["nope"] + s["v"]), s["kv_rank"])
    linear(p + "self_attn.o_proj", s["emb"], s["heads"] * s["v"])
    if i < s["dense"]:
      for name, rows, cols in (("gate_proj", s["mlp"], s["emb"]), ("up_proj", s["mlp"], s["emb"]),
                               ("down_proj", s["emb"], s["mlp"])):
        linear(p + "mlp." + name, rows, cols)
      continue
    out.append((p + "mlp.gate.weight", "BF16", [s["experts"], s["emb"]]))
    out.append((p + "mlp.gate.e_score_correction_bias", "F32", [s["experts"]]))
    for expert in [f"experts.{j}" for j in range(s["experts"])] + ["shared_experts"]:
      for name, rows, cols in (("gate_proj", s["moe"], s["emb"]), ("up_proj", s["moe"], s["emb"]),
                               ("down_proj", s["emb"], s["moe"])):
        linear(f"{p}mlp.{expert}.{name}", rows, cols)
    if i == s["layers"]:
      for norm in ("enorm", "hnorm", "shared_head.norm"):
        out.append((p + norm + ".weight", "BF16", [s["emb"]]))
      linear(p + "eh_proj", s["emb"], 2 * s["emb"])
      out.append((p + "embed_tokens.weight", "BF16", [s["vocab"], s["emb"]]))
      out.append((p + "shared_head.head.weight", "BF16", [s["vocab"], s["emb"]]))
  out += [("model.norm.weight", "BF16", [s["emb"]]), ("lm_head.weight", "BF16", [s["vocab"], s["emb"]])]
  return out


def write_release(root: str, s: dict) -> int:
  """The release as sparse shards, its index and config.json; returns the shards' total size in bytes."""
  tensors = _tensors(s)
  sizes = [math.prod(shape) * BITS[dtype] // 8 for _, dtype, shape in tensors]
  per_shard, total, weight_map, cumulative = sum(sizes) / s["shards"], 0, {}, 0
  groups = [[] for _ in range(s["shards"])]  # consecutive tensors, about the same bytes a shard
  for tensor, size in zip(tensors, sizes):
    groups[min(s["shards"] - 1, int((cumulative + size / 2) // per_shard))].append((tensor, size))
    cumulative += size
  for k, group in enumerate(groups):
    name = f"model-{k + 1:05d}-of-{s['shards']:05d}.safetensors"
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for (tensor, dtype, shape), size in group:
      header[tensor] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
      weight_map[tensor] = name
      offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    with open(os.path.join(root, name), "wb") as f:
      f.write(struct.pack("<Q", len(raw)) + raw)
      f.truncate(8 + len(raw) + offset)  # the tensor data: a hole
    total += 8 + len(raw) + offset
  with open(os.path.join(root, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
    json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=2)
  config = hf_sources.config_json(s["emb"], s["moe"], s["mlp"], s["experts"], s["layers"], s["vocab"])
  config.update(num_attention_heads=s["heads"], num_key_value_heads=s["heads"], q_lora_rank=s["q_rank"],
                kv_lora_rank=s["kv_rank"], qk_nope_head_dim=s["nope"], qk_rope_head_dim=s["rope"],
                v_head_dim=s["v"], first_k_dense_replace=s["dense"], num_experts_per_tok=8 if s["experts"] > 8 else 2,
                n_group=8 if s["experts"] > 8 else 1, topk_group=4 if s["experts"] > 8 else 1,
                num_nextn_predict_layers=1, torch_dtype="bfloat16",
                quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]})
  with open(os.path.join(root, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return total


def _timed(args: list[str]) -> tuple[float, str]:
  began = time.monotonic()
  out = subprocess.run([sys.executable, "-m", "inspect_tool", *args], capture_output=True, text=True, cwd=REPO,
                       check=False)
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(args)} failed: {out.stderr[-2000:]}")
  return time.monotonic() - began, out.stdout


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default=None, help="where to write the sparse release (default: a temporary dir)")
  parser.add_argument("--tiny", action="store_true", help="a smoke run: 4 layers, 8 experts, 8 shards")
  args = parser.parse_args()
  s = _shape(not args.tiny)
  with tempfile.TemporaryDirectory(dir=args.dir) as root:
    release = os.path.join(root, "release")
    os.mkdir(release)
    total = write_release(release, s)
    headers = 0
    for name in sorted(os.listdir(release)):
      if name.endswith(".safetensors"):
        with open(os.path.join(release, name), "rb") as f:
          headers += 8 + struct.unpack("<Q", f.read(8))[0]
    small = sum(os.path.getsize(os.path.join(release, n)) for n in ("config.json", "model.safetensors.index.json"))
    label = "tiny" if args.tiny else "DeepSeek-V3 671B-shaped"
    print(f"{label} release: {s['shards']} shards, {total / 1e9:.3f} GB; headers {headers / 1e6:.3f} MB, "
          f"index + config.json {small / 1e6:.3f} MB")
    print(f"{'case':<24}{'local s':>10}{'http s':>10}{'http/local':>12}{'bytes served':>16}{'of the shards':>16}")
    with WebServer(root) as server:
      for case in (["--summary"], ["--keys"]):
        local, local_out = _timed(["hf", "--path", release, *case])
        server.reset()
        remote, remote_out = _timed(["hf", "--path", f"{server.url}/release", *case])
        same = remote_out.replace(f"{server.url}/release", release) == local_out
        served = sum(server.sent.values())
        print(f"{'hf ' + case[0]:<24}{local:>10.2f}{remote:>10.2f}{remote / local:>11.2f}x{served:>16,}"
              f"{100 * served / total:>15.4f}%" + ("" if same else "  (OUTPUT DIFFERS)"))
        shards = sum(v for k, v in server.sent.items() if k.endswith(".safetensors"))
        print(f"  of which safetensors headers: {shards:,} bytes (the headers are {headers:,}); "
              f"{len(server.log)} requests")


if __name__ == "__main__":
  main()
