"""Test-side numpy (float64) reference of a DeepSeek-V3 forward pass on Hugging Face tensors, MTP head included.

Written from the published architecture (DeepSeek-V3 report; Hugging Face's DeepseekV3 modeling as the reading of
its config fields), independently of the library: MLA attention with YaRN rotary embeddings, sigmoid routing with the
correction bias and group-limited top-k, shared experts, RMSNorm. The MTP depth follows the report and MaxText: the
main model's last hidden state (before the final norm) and the embedding of the next token, each normalized
(`hnorm`, `enorm`), concatenated [embedding, hidden], projected by `eh_proj`, one decoder layer, `shared_head.norm`,
then the main output head. `main_logits` is checked against transformers' own logits, which validates the reference
before its MTP logits are used.
"""

from __future__ import annotations

import math

import numpy as np


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _yarn_inv_freq(cfg) -> np.ndarray:
  rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  dim, base = cfg["qk_rope_head_dim"], rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  if rope.get("rope_type", rope.get("type")) != "yarn":
    return 1.0 / pos_freqs
  factor, original = rope["factor"], rope["original_max_position_embeddings"]

  def correction_dim(rotations):
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low = max(math.floor(correction_dim(rope.get("beta_fast", 32))), 0)
  high = min(math.ceil(correction_dim(rope.get("beta_slow", 1))), dim - 1)
  high = high + 0.001 if low == high else high
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _softmax_scale(cfg) -> float:
  rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
  mscale_all_dim = rope.get("mscale_all_dim", 0)
  if rope.get("rope_type", rope.get("type")) == "yarn" and mscale_all_dim:
    m = 0.1 * mscale_all_dim * math.log(rope["factor"]) + 1.0
    scale *= m * m
  return scale


def _rope(x, positions, inv_freq, interleaved: bool):
  """Rotates the last axis of x [B, S, (H,) dr]; interleaved storage pairs (2i, 2i+1), else (i, i + dr/2)."""
  if interleaved:  # to the half layout first, as the interleaved checkpoints are read
    x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  angles = positions[..., None] * inv_freq  # [B, S, dr/2]
  cos, sin = np.cos(angles), np.sin(angles)
  if x.ndim == 4:
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  half = x.shape[-1] // 2
  a, b = x[..., :half], x[..., half:]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class Reference:
  """The model of `config` (config.json as a dict) on `tensors` (HF name -> array), in float64."""

  def __init__(self, config: dict, tensors: dict):
    self.c = config
    self.t = {name: np.asarray(value, np.float64) for name, value in tensors.items()}
    self.eps = config["rms_norm_eps"]
    self.inv_freq = _yarn_inv_freq(config)
    self.scale = _softmax_scale(config)

  def _w(self, name):
    return self.t[name]

  def attention(self, p, x, positions):
    c = self.c
    h, dn, dr, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    b, s, _ = x.shape
    if c.get("q_lora_rank"):
      q = _rms(x @ self._w(p + "q_a_proj.weight").T, self._w(p + "q_a_layernorm.weight"), self.eps)
      q = q @ self._w(p + "q_b_proj.weight").T
    else:
      q = x @ self._w(p + "q_proj.weight").T
    q = q.reshape(b, s, h, dn + dr)
    kv_a = x @ self._w(p + "kv_a_proj_with_mqa.weight").T
    latent, k_pe = kv_a[..., :c["kv_lora_rank"]], kv_a[..., c["kv_lora_rank"]:]
    kv = (_rms(latent, self._w(p + "kv_a_layernorm.weight"), self.eps) @ self._w(p + "kv_b_proj.weight").T)
    kv = kv.reshape(b, s, h, dn + dv)
    interleaved = bool(c.get("rope_interleave", True))
    q_pe = _rope(q[..., dn:], positions, self.inv_freq, interleaved)
    k_pe = _rope(k_pe, positions, self.inv_freq, interleaved)[:, :, None, :]
    scores = (np.einsum("bqhd,bkhd->bhqk", q[..., :dn], kv[..., :dn])
              + np.einsum("bqhd,bkxd->bhqk", q_pe, k_pe)) * self.scale
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, kv[..., dn:]).reshape(b, s, h * dv)
    return out @ self._w(p + "o_proj.weight").T

  def mlp(self, p, x):
    return (_silu(x @ self._w(p + "gate_proj.weight").T) * (x @ self._w(p + "up_proj.weight").T)) @ (
        self._w(p + "down_proj.weight").T)

  def moe(self, p, x):
    c = self.c
    scores = 1.0 / (1.0 + np.exp(-(x @ self._w(p + "gate.weight").T)))  # [B, S, X]
    choice = scores + self._w(p + "gate.e_score_correction_bias")
    x_count, groups, k = c["n_routed_experts"], c.get("n_group") or 1, c["num_experts_per_tok"]
    grouped = choice.reshape(*choice.shape[:-1], groups, x_count // groups)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # the sum of each group's top two
    keep = np.argsort(-group_scores, axis=-1, kind="stable")[..., :c.get("topk_group") or 1]
    mask = np.zeros(group_scores.shape, bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    masked = np.where(np.repeat(mask, x_count // groups, axis=-1), choice, -np.inf)
    top = np.argsort(-masked, axis=-1, kind="stable")[..., :k]
    weights = np.take_along_axis(scores, top, axis=-1)
    if c.get("norm_topk_prob", True):
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * c["routed_scaling_factor"]
    out = self.mlp(p + "shared_experts.", x)
    for j in range(x_count):
      w = np.where(top == j, weights, 0.0).sum(-1, keepdims=True)
      if w.any():
        out = out + w * self.mlp(p + f"experts.{j}.", x)
    return out

  def layer(self, i, x, positions):
    p = f"model.layers.{i}."
    x = x + self.attention(p + "self_attn.", _rms(x, self._w(p + "input_layernorm.weight"), self.eps), positions)
    normed = _rms(x, self._w(p + "post_attention_layernorm.weight"), self.eps)
    ffn = self.mlp(p + "mlp.", normed) if i < self.c["first_k_dense_replace"] else self.moe(p + "mlp.", normed)
    return x + ffn

  def hidden(self, tokens):
    """The main model's last hidden state (before `model.norm`) of tokens [B, S]."""
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.float64), tokens.shape)
    x = self._w("model.embed_tokens.weight")[tokens]
    for i in range(self.c["num_hidden_layers"]):
      x = self.layer(i, x, positions)
    return x

  def main_logits(self, tokens):
    return _rms(self.hidden(tokens), self._w("model.norm.weight"), self.eps) @ self._w("lm_head.weight").T

  def mtp_logits(self, tokens):
    """Depth 1: the token one step ahead (the last position gets token 0), its nextn layer `num_hidden_layers`."""
    n = self.c["num_hidden_layers"]
    p = f"model.layers.{n}."
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.float64), tokens.shape)
    ahead = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    embedding = _rms(self._w("model.embed_tokens.weight")[ahead], self._w(p + "enorm.weight"), self.eps)
    hidden = _rms(self.hidden(tokens), self._w(p + "hnorm.weight"), self.eps)
    x = np.concatenate([embedding, hidden], axis=-1) @ self._w(p + "eh_proj.weight").T
    x = self.layer(n, x, positions)
    return _rms(x, self._w(p + "shared_head.norm.weight"), self.eps) @ self._w("lm_head.weight").T
