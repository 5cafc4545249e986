"""The programs compiled for a topology: MaxText's training step and the forward pass, as pure functions.

`train_step(graphdef, tx, cfg)`: the loss (main + `mtp_loss_scaling_factor` × MTP, `run.forward.pure_forward`),
its gradients for the Params, MaxText's gradient clipping (`gradient_clipping_threshold`, by global norm), the
optimizer update; the state (parameters and optimizer state) is donated, as MaxText's `train_compile` does.
`forward(graphdef)`: the forward pass `forward` and the export's validation run (logits, losses, MTP outputs).
Inputs are MaxText's batch keys (`state.BATCH_KEYS`): `targets_segmentation` is the loss mask.
"""

from __future__ import annotations

from flax import nnx
import jax
import optax

from inspect_tool.run import forward as forward_lib


def _outputs(graphdef, params, rest, batch, mtp_scale: float):
  rest = jax.tree.map(lambda a: a, rest)  # fresh Variables at this trace level (the model writes non-Param state)
  return forward_lib.pure_forward(graphdef, nnx.merge_state(params, rest), batch["inputs"], batch["inputs_position"],
                                  batch["inputs_segmentation"], batch["targets"], batch["targets_segmentation"],
                                  mtp_scale=mtp_scale)


def train_step(graphdef, tx, cfg):
  """step(params, opt_state, rest, batch) → (params, opt_state, loss)."""
  scale = float(cfg.mtp_loss_scaling_factor)
  clip = float(cfg.gradient_clipping_threshold)

  def loss_fn(params, rest, batch):
    out = _outputs(graphdef, params, rest, batch, scale)
    return out["total_loss"] if "total_loss" in out else out["loss"]

  def step(params, opt_state, rest, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, rest, batch)
    if clip > 0:
      grads, _ = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def forward(graphdef, cfg):
  """fn(params, rest, batch) → the forward pass's outputs (logits, top-1, losses, MTP logits and losses)."""
  scale = float(cfg.mtp_loss_scaling_factor)

  def fn(params, rest, batch):
    return _outputs(graphdef, params, rest, batch, scale)

  return fn
