"""An ESTIMATE of the activation bytes one device holds in MaxText's training step (forward + backward).

Not exact (parameters, optimizer state and gradients are: `memory`): XLA decides what lives when. The formula
counts the tensors the backward pass needs, per device, from the config alone. With

  B = per_device_batch_size, S = max_target_length, T = B·S tokens, a = bytes of `dtype` (bf16: 2), f = 4,
  E = emb_dim, H = num_query_heads, dq = qk_nope_head_dim + qk_rope_head_dim, dv = v_head_dim,
  rq = q_lora_rank, rkv = kv_lora_rank, dr = qk_rope_head_dim, X = num_experts, K = num_experts_per_tok,
  M = moe_mlp_dim, D = mlp_dim, V = vocab_size,

one layer saves, per token, in the compute dtype (elements):
  attention (MLA)  A = 4E + 2·rq + 3·H·dq + (rkv + dr) + rkv + H·(dnope + dv) + H·dv
  dense MLP        4·D + E
  MoE              2·(f/a)·X + K·(2E + 4M) + 2·(f/a)·K·E + 4·shared_experts·M + E
and, with `attention=dot_product` (scores materialised), B·H·S² attention scores in the compute dtype and float32
(a + f bytes each); flash attention (MaxText's `autoselected` on TPU and GPU) keeps none. The output head (main,
and each MTP depth) holds T·V float32 logits and their gradient: 2·f·T·V. The MTP block (not rematerialised)
saves, per depth, its layer's activations plus 3E per token (the two norms and the projection input).

  remat_policy=full   L·T·E·a (each scanned layer's input) + max(the largest decoder layer's activations,
                      recomputed for its backward; the MTP block's) + heads. The backward pass meets the MTP
                      block's activations and a recomputed layer's one after the other, not together.
  any other policy    every layer's activations + the MTP block + heads (an upper bound: MaxText's other
                      policies save a subset; `minimal` e.g. keeps only the matmul outputs)

Activations are taken per device for the batch only: tensor, sequence and context parallelism would divide some
of them further, so with those the figure is an upper bound. `tests/test_activations.py` checks it against
XLA's `memory_analysis().temp_size_in_bytes` of the forward + backward step (`run.runner.grad_step`) on CPU.
"""

from __future__ import annotations

import dataclasses

from inspect_tool.paramtree import summary as summary_lib

F32 = 4


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
  """Bytes per device by part; `total` is their sum. An estimate (see the module docstring)."""

  batch: float
  seq: int
  remat_policy: str
  parts: tuple[tuple[str, float], ...]

  @property
  def total(self) -> float:
    return sum(b for _, b in self.parts)

  def to_dict(self) -> dict:
    return {"estimate": True, "per_device_batch_size": self.batch, "max_target_length": self.seq,
            "remat_policy": self.remat_policy, "parts": dict(self.parts), "total_bytes": self.total}


def _dtype_bytes(name) -> int:
  # lazy: NumPy, ~0.05 s to import; ml_dtypes (and NumPy), ~0.05 s to import: `hf --path` loads this module without it
  import numpy as np  # pylint: disable=import-outside-toplevel
  import ml_dtypes  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import  (registers bfloat16 with numpy)

  return np.dtype(str(name)).itemsize


def _attention_width(cfg) -> float:
  e, h = cfg.emb_dim, cfg.num_query_heads
  dq, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
  rq, rkv, dr = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  return 4 * e + 2 * rq + 3 * h * dq + (rkv + dr) + rkv + h * (cfg.qk_nope_head_dim + dv) + h * dv


def _mlp_width(cfg, moe: bool, a: int) -> float:
  e = cfg.emb_dim
  if not moe:
    return 4 * cfg.mlp_dim + e
  x, k, m = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim
  return 2 * (F32 / a) * x + k * (2 * e + 4 * m) + 2 * (F32 / a) * k * e + 4 * cfg.shared_experts * m + e


def estimate(cfg, *, batch: float | None = None, seq: int | None = None,
             remat_policy: str | None = None) -> ActivationEstimate:
  """The activation estimate for `cfg` (batch, seq and policy default to the config's keys)."""
  batch = float(cfg.per_device_batch_size if batch is None else batch)
  seq = int(cfg.max_target_length if seq is None else seq)
  policy = str(remat_policy if remat_policy is not None else getattr(cfg, "remat_policy", "full"))
  a = _dtype_bytes(cfg.dtype)
  tokens = batch * seq
  scores = (a + F32) * batch * cfg.num_query_heads * seq * seq if str(cfg.attention) == "dot_product" else 0.0
  attention = tokens * a * _attention_width(cfg) + scores
  dense = attention + tokens * a * _mlp_width(cfg, False, a)
  moe = attention + tokens * a * _mlp_width(cfg, True, a)
  n_dense, n_moe = cfg.first_num_dense_layers, cfg.num_moe_layers
  layers = n_dense * dense + n_moe * moe
  depths = int(cfg.mtp_num_layers)
  mtp_block = depths * (moe if n_moe else dense) + depths * tokens * a * 3 * cfg.emb_dim
  if policy == "full":
    largest = max([dense] * bool(n_dense) + [moe] * bool(n_moe), default=0.0)
    parts = [("layer inputs (remat_policy=full)", (n_dense + n_moe) * tokens * cfg.emb_dim * a),
             ("one layer recomputed" if largest >= mtp_block else "MTP block", max(largest, mtp_block))]
  else:
    parts = [(f"decoder layers (remat_policy={policy}: all saved)", layers)]
    if depths:
      parts.append(("MTP block", mtp_block))
  parts.append(("output heads (float32 logits and gradient)", (1 + depths) * 2 * F32 * tokens * cfg.vocab_size))
  return ActivationEstimate(batch, seq, policy, tuple(parts))


def describe(est: ActivationEstimate) -> str:
  """One line: the figure, labelled an estimate, with what it assumed."""
  batch = int(est.batch) if float(est.batch).is_integer() else est.batch
  return (f"activations (estimate, per_device_batch_size={batch}, max_target_length={est.seq}, "
          f"remat_policy={est.remat_policy}): {summary_lib.human_bytes(est.total)}")

