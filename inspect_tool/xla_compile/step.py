"""The programs compiled for a topology: MaxText's training step and the forward pass, as pure functions.

`train_step(graphdef, tx, cfg)`: MaxText's loss (the main loss with MaxText's own cross-entropy, `loss`;
`mtp_loss_scaling_factor` × the MTP losses; the MoE load-balance loss; with an indexer (`use_indexer`) in its dense
warm-up, `indexer_sparse_training=false` as MaxText's default is, MaxText leaves the main loss out, and so does this
step), its gradients for the Params, MaxText's gradient clipping (`gradient_clipping_threshold`, by global norm),
the optimizer update; the state (parameters and optimizer state) is donated, as MaxText's `train_compile` does.
`forward(graphdef)`: the forward pass `forward` and the export's validation run (logits, losses, MTP outputs).
Inputs are MaxText's batch keys (`state.BATCH_KEYS`): `targets_segmentation` is the loss mask.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from inspect_tool.run import forward as forward_lib
from inspect_tool.xla_compile import loss as loss_lib


def _outputs(graphdef, params, rest, batch, mtp_scale: float):
  rest = jax.tree.map(lambda a: a, rest)  # fresh Variables at this trace level (the model writes non-Param state)
  return forward_lib.pure_forward(graphdef, nnx.merge_state(params, rest), batch["inputs"], batch["inputs_position"],
                                  batch["inputs_segmentation"], batch["targets"], batch["targets_segmentation"],
                                  mtp_scale=mtp_scale)


def _l2norm(tree):
  """The L2 norm of a tree's leaves, summed leaf by leaf as MaxText's step metrics are."""
  return jnp.sqrt(jax.tree_util.tree_reduce(lambda acc, x: acc + jnp.sum(jnp.square(x)), tree, initializer=0.0))


def train_step(graphdef, tx, cfg):
  """step(params, opt_state, rest, batch) → (params, opt_state, metrics): MaxText's step metrics (the loss, the main
  loss and its perplexity, Σ xent and the token count, the MTP and load-balance losses, the norms of the clipped and
  raw gradients and of the updated parameters)."""
  scale = float(cfg.mtp_loss_scaling_factor)
  clip = float(cfg.gradient_clipping_threshold)

  warmup = bool(cfg.use_indexer) and not bool(cfg.indexer_sparse_training)
  vocab, z_loss = int(cfg.vocab_size), float(cfg.z_loss_multiplier)

  def loss_fn(params, rest, batch):
    out = _outputs(graphdef, params, rest, batch, scale)
    weights = jnp.sum(batch["targets_segmentation"] != 0)
    loss, xent_sum = 0.0, 0.0
    if not warmup:  # the indexer's dense warm-up: MaxText leaves the main loss out
      loss, xent_sum, weights = loss_lib.main_loss(out["logits"], batch["targets"], batch["targets_segmentation"],
                                                   vocab, z_loss)
    aux = {"xent_sum": xent_sum, "total_weights": weights, "mtp_loss": out.get("mtp_loss", 0.0),
           "moe_lb_loss": out.get("moe_lb_loss", 0.0)}
    return loss + aux["mtp_loss"] + aux["moe_lb_loss"], aux

  def step(params, opt_state, rest, batch):
    (loss, aux), raw = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)
    grads = optax.clip_by_global_norm(clip).update(raw, optax.EmptyState())[0] if clip > 0 else raw
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    lm_loss = aux["xent_sum"] / (aux["total_weights"] + loss_lib.EPS)
    metrics = {"loss": loss, "lm_loss": lm_loss, "perplexity": jnp.exp(lm_loss), **aux, "grad_norm": _l2norm(grads),
               "raw_grad_norm": _l2norm(raw), "param_norm": _l2norm(params)}
    return params, opt_state, metrics

  return step


def forward(graphdef, cfg):
  """fn(params, rest, batch) → the forward pass's outputs (logits, top-1, losses, MTP logits and losses)."""
  scale = float(cfg.mtp_loss_scaling_factor)

  def fn(params, rest, batch):
    return _outputs(graphdef, params, rest, batch, scale)

  return fn
