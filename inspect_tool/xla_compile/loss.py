"""The main loss of MaxText 0.2.5's training step: cross-entropy against one-hot targets with its own gradient.

MaxText computes the main loss with `jax.nn.one_hot(targets, vocab_size)` and a `custom_vjp` cross-entropy whose
forward keeps, for the backward, the logits, the one-hot targets, exp(logits - max) and its sum, and whose backward
is g·(exp(logits - max)/sum - targets) (with the z-loss factor); the loss is Σ xent·mask / (Σ mask + 1e-8). What
the compiled step holds between the loss and its gradient follows from those saved arrays, so the step computes
its main loss this way (the MTP losses take integer labels, as MaxText's MTP block does: `model.mtp`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from inspect_tool.model import mtp
from inspect_tool.model import partitioning

EPS = 1e-8


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def cross_entropy(logits, targets, z_loss: float = 0.0):
  """Per-token -Σ targets·log_softmax(logits) + z_loss·log(Σ exp)², and the z-loss term alone."""
  return _forward(logits, targets, z_loss)[0]


def _forward(logits, targets, z_loss):
  peak = jnp.max(logits, axis=-1, keepdims=True)
  shifted = logits - peak
  exp = jnp.exp(shifted)
  total = jnp.sum(exp, axis=-1, keepdims=True)
  xent = -jnp.sum(targets * (shifted - jnp.log(total)), axis=-1)
  log_z = jnp.squeeze(jnp.log(total) + peak, axis=-1)
  z_term = z_loss * jax.lax.square(log_z)
  return (xent + z_term, z_term), (logits, targets, exp, total, log_z)


def _backward(z_loss, saved, g):
  logits, targets, exp, total, log_z = saved
  deriv = jnp.expand_dims(1 + 2 * z_loss * log_z, -1) * exp / total - targets
  return jnp.asarray(jnp.expand_dims(g[0], -1) * deriv, logits.dtype), None


cross_entropy.defvjp(_forward, _backward)


def main_loss(logits, targets, mask, vocab_size: int, z_loss: float = 0.0):
  """(MaxText's normalised main loss, Σ xent, Σ mask) of `logits` [B, S, V] for integer `targets` [B, S] where
  `mask` [B, S] != 0."""
  xent, _ = cross_entropy(logits, jax.nn.one_hot(targets, vocab_size), z_loss)
  keep = mask != 0
  xent_sum = jnp.sum(partitioning.constrain(xent, mtp.PER_TOKEN) * keep)
  weights = jnp.sum(keep)
  return xent_sum / (weights + EPS), xent_sum, weights
