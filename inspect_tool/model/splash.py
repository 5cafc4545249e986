"""Attention as MaxText runs it on TPU for training (`attention=flash`, or `autoselected` from 128 tokens): the Pallas
splash-attention kernel, per device (`shard_map`), for a model traced for a TPU mesh (`partitioning`).

The scores are never materialised: the kernel keeps per-block running softmax statistics (MaxText's block sizes,
`sa_block_*`, 512 by default, capped by the sequence), saves its output and log-sum-exp for the backward kernels,
and masks causally (and by segment when segment ids are given). The softmax scale is already in the query, as
MaxText folds it. Batch and heads are sharded as MaxText's `activation_batch_attn` / `activation_heads` say.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from inspect_tool.model import partitioning
from quant import compat

MIN_LENGTH = 128  # below this MaxText's `autoselected` uses dot-product attention
BLOCK_KEYS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv", "sa_block_kv_dkv",
              "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")


def applies(attention: str, length: int) -> bool:
  """Whether a model traced for a TPU mesh runs splash attention for `attention` on `length` tokens."""
  part = partitioning.active()
  if part is None or part.platform != "tpu":
    return False
  return attention == "flash" or attention == "autoselected" and length >= MIN_LENGTH


def attend(query, key, value, segment_ids, blocks: tuple[int, ...]):
  """[B, T, H, Dqk] queries, [B, S, H, Dqk] keys, [B, S, H, Dv] values → [B, T, H, Dv], causal; `blocks`: the
  config's `BLOCK_KEYS` values, in that order."""
  kernel_lib, mask_lib = compat.splash_attention()
  part = partitioning.active()
  t, s = query.shape[1], key.shape[1]
  spec = part.of(("activation_batch_attn", "activation_heads", "activation_length_attn", None))
  segment_spec = jax.sharding.PartitionSpec(spec[0], spec[2])
  local_heads = query.shape[2] // part.axis_size(("activation_heads",))
  sizes = {k: min(int(b), t if "_q" in k else s) for k, b in zip(BLOCK_KEYS, blocks)}
  block_sizes = kernel_lib.BlockSizes(
      block_q=sizes["sa_block_q"], block_kv=sizes["sa_block_kv"], block_kv_compute=sizes["sa_block_kv_compute"],
      block_q_dkv=sizes["sa_block_q_dkv"], block_kv_dkv=sizes["sa_block_kv_dkv"],
      block_kv_dkv_compute=sizes["sa_block_kv_dkv_compute"], block_q_dq=sizes["sa_block_q_dq"],
      block_kv_dq=sizes["sa_block_kv_dq"])
  mask = mask_lib.MultiHeadMask(masks=(mask_lib.CausalMask(shape=(t, s)),) * local_heads)
  kernel = kernel_lib.make_splash_mha(mask=mask, head_shards=1, q_seq_shards=1, block_sizes=block_sizes,
                                      residual_checkpoint_name="context")
  if segment_ids is None:
    segment_ids = jnp.ones(query.shape[:2], jnp.int32)

  def body(q, k, v, seg):
    ids = kernel_lib.SegmentIds(q=seg, kv=seg)
    return jax.vmap(kernel)(q, k, v, ids)

  heads_first = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # pylint: disable=unnecessary-lambda-assignment
  out = jax.shard_map(body, mesh=part.mesh, in_specs=(spec, spec, spec, segment_spec), out_specs=spec,
                      check_vma=False)(heads_first(query), heads_first(key), heads_first(value), segment_ids)
  return heads_first(out)
