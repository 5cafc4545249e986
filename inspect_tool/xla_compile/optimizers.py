"""MaxText 0.2.5's optimizers for the compiled training step (`opt_type`: adamw, adam_pax, sgd), with its schedule.

- The learning rate is MaxText's schedule, a function of the step count (so every optimizer keeps a count): a
  linear warm-up over `warmup_steps_fraction` of `learning_rate_schedule_steps` (`steps` when -1), then a cosine
  from `learning_rate` down to `learning_rate_final_fraction` of it.
- `adamw`: optax's AdamW with mu at `mu_dtype`; the parameters whose path matches one of `adamw_mask`'s patterns
  get no weight decay.
- `adam_pax`: Pax's Adam, as MaxText ports it: the moment decays are bias-corrected (β·(1-β^(t-1))/(1-β^t)) instead
  of the moments, both moments at the parameter's dtype, weight decay added to the update.
- `sgd`: optax's SGD (no momentum), under the schedule.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax


def schedule(cfg):
  """MaxText's cosine learning-rate schedule (its WSD variant has the same state: a step count)."""
  peak = float(cfg.learning_rate)
  total = int(cfg.learning_rate_schedule_steps)
  total = int(cfg.steps) if total <= 0 else total
  warmup = int(total * float(cfg.warmup_steps_fraction))
  final = peak * float(cfg.learning_rate_final_fraction)
  span = max(total - warmup, 1)

  def cosine(step):
    pct = step / (span - 1) if span > 1 else 1.0
    a = 0.5 * (jnp.cos(jnp.pi * pct) + 1)
    return peak * a + final * (1 - a)

  pieces = ([optax.linear_schedule(0.0, peak, warmup)] if warmup > 0 else []) + [cosine]
  return optax.join_schedules(pieces, [warmup]) if warmup > 0 else cosine


def decay_mask(cfg):
  """adamw's weight-decay mask from `adamw_mask` (paths matching a pattern are left out), None when empty."""
  patterns = [re.compile(p) for p in (cfg.adamw_mask or ())]
  if not patterns:
    return None

  def mask(params):
    def keep(path, _):
      text = jax.tree_util.keystr(path, simple=True, separator="/")
      return not any(p.search(text) for p in patterns)
    return jax.tree_util.tree_map_with_path(keep, params)

  return mask


def adam_pax(learning_rate, b1: float, b2: float, eps: float, eps_root: float, weight_decay: float, mask=None):
  """Pax's Adam (module docstring) as an optax transformation."""

  def init(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # pylint: disable=unnecessary-lambda-assignment
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

  def decay(count, beta):
    t = count.astype(jnp.float32) + 1.0
    return beta * (1.0 - jnp.power(beta, t - 1.0)) / (1.0 - jnp.power(beta, t))

  def update(grads, state, params=None):
    d1 = lambda g: decay(state.count, b1).astype(g.dtype)  # pylint: disable=unnecessary-lambda-assignment
    d2 = lambda g: decay(state.count, b2).astype(g.dtype)  # pylint: disable=unnecessary-lambda-assignment
    mu = jax.tree.map(lambda g, m: (1.0 - d1(g)) * g + d1(g) * m, grads, state.mu)
    nu = jax.tree.map(lambda g, v: (1.0 - d2(g)) * g * g + d2(g) * v, grads, state.nu)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu, nu)
    if weight_decay > 0:
      keep = mask(params) if mask is not None else jax.tree.map(lambda _: True, params)
      out = jax.tree.map(lambda u, p, k: u + weight_decay * p if k else u, out, params, keep)
    step = -1.0 * learning_rate(state.count)
    return jax.tree.map(lambda u: step * u, out), optax.ScaleByAdamState(state.count + 1, mu, nu)

  return optax.GradientTransformation(init, update)


def optimizer(cfg, name: str):
  """MaxText's optimizer `name` (adamw, adam_pax, sgd) with the config's hyper-parameters and schedule."""
  lr = schedule(cfg)
  if name == "sgd":
    return optax.sgd(lr)
  args = dict(b1=float(cfg.adam_b1), b2=float(cfg.adam_b2), eps=float(cfg.adam_eps),
              eps_root=float(cfg.adam_eps_root), weight_decay=float(cfg.adam_weight_decay), mask=decay_mask(cfg))
  if name == "adam_pax":
    return adam_pax(lr, **args)
  return optax.adamw(lr, mu_dtype=str(cfg.mu_dtype or cfg.weight_dtype), **args)
