"""Library forward pass: tokens → main logits, per-token cross-entropy, loss, MTP logits / losses, top-1.

`run_forward` jits one pure function per model graph (the graph is static, the variables are inputs), so a
Qwix-quantized model (whose class intercepts `__call__`) is traced with its interception. Losses follow
MaxText's training step: main loss = Σ xent·mask / Σ mask; MTP loss = λ·Σ_k L_k / (Σ_k W_k + 1e-8) with
λ = `mtp_loss_scaling_factor`; `total_loss` = main + MTP loss; with `load_balance_loss_weight` > 0, `moe_lb_loss`
is the mean of the routed layers' load-balance losses.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from inspect_tool.model import moe
from inspect_tool.model import mtp

MTP_EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class ForwardResult:
  """Arrays of one forward pass (B: batch, S: sequence, V: vocab, P: MTP depths)."""

  logits: Any  # (B, S, V) float32
  top1: Any  # (B, S) int32
  xent: Any | None = None  # (B, S) float32 per-token cross-entropy, masked (None without targets)
  loss: Any | None = None  # () main loss
  mtp_logits: Any | None = None  # (P, B, S, V) float32, None without MTP
  mtp_top1: Any | None = None  # (P, B, S) int32
  mtp_losses: Any | None = None  # (P,) masked cross-entropy sums per depth
  mtp_weights: Any | None = None  # (P,) token counts per depth
  mtp_loss: Any | None = None  # () λ·ΣL/(ΣW + 1e-8)
  total_loss: Any | None = None  # () loss + mtp_loss
  moe_lb_loss: Any | None = None  # () the mean of the routed layers' load-balance losses (load_balance_loss_weight > 0)


def pure_forward(graphdef, state, tokens, positions, segment_ids, targets, target_mask, mtp_scale):
  """Merges the model, runs it, and returns the result arrays (the model's intermediates are dropped)."""

  model = nnx.merge(graphdef, state)
  logits = model(tokens, positions, segment_ids, decoder_target_tokens=targets, decoder_target_mask=target_mask,
                 enable_dropout=False)
  out = {"logits": logits, "top1": jnp.argmax(logits, axis=-1).astype(jnp.int32)}
  if targets is not None:
    mask = (jnp.ones_like(tokens) if target_mask is None else target_mask != 0).astype(jnp.float32)
    xent = mtp.cross_entropy(logits, targets) * mask
    out["xent"] = xent
    out["loss"] = jnp.sum(xent) / jnp.sum(mask)
  balance = [jnp.ravel(leaf) for leaf in jax.tree.leaves(nnx.state(model, moe.moe_lb_loss))]
  if balance:
    out["moe_lb_loss"] = jnp.mean(jnp.concatenate(balance))
  block = getattr(model, "mtp_block", None)
  if block is not None:
    out["mtp_logits"] = block.logits[...]
    out["mtp_top1"] = jnp.argmax(out["mtp_logits"], axis=-1).astype(jnp.int32)
    if targets is not None:
      losses, weights = block.losses[...], block.weights[...]
      out["mtp_losses"], out["mtp_weights"] = losses, weights
      out["mtp_loss"] = mtp_scale * jnp.sum(losses) / (jnp.sum(weights) + MTP_EPS)
      out["total_loss"] = out["loss"] + out["mtp_loss"]
  return out


@functools.lru_cache(maxsize=None)
def _jitted():
  return jax.jit(pure_forward, static_argnums=(0,), static_argnames=("mtp_scale",))


def run_forward(model, tokens, *, targets=None, target_mask=None, positions=None, segment_ids=None,
                jit: bool = True) -> ForwardResult:
  """Runs `model` (a built, real `Transformer`, possibly Qwix-quantized) on `tokens` [B, S].

  Args:
    model: the model.
    tokens: int token ids [B, S].
    targets: int next-token ids [B, S]; without them no losses are computed.
    target_mask: [B, S], nonzero where a target counts (default: all).
    positions: [B, S] (default: 0..S-1 per row).
    segment_ids: [B, S] (default: none, i.e. causal attention over the whole row).
    jit: False runs eagerly (for debugging).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [batch, sequence], got shape {tokens.shape}")
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  as_int = lambda x: None if x is None else jnp.asarray(x, jnp.int32)  # pylint: disable=unnecessary-lambda-assignment
  graphdef, state = nnx.split(model)
  cfg = getattr(model, "config", None)
  scale = float(getattr(cfg, "mtp_loss_scaling_factor", 0.1))
  fn = _jitted() if jit else pure_forward
  out = fn(graphdef, state, tokens, as_int(positions), as_int(segment_ids), as_int(targets), as_int(target_mask),
           mtp_scale=scale)
  return ForwardResult(**out)
