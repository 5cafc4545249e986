"""Running the model for real: build (random init or checkpoint), quantize on the fly (Qwix QT), forward, grad.

The quantized forward pass is MaxText's `quantization=fp8_full` training semantics: the model is wrapped by
`qwix.quantize_model` with a `QtProvider` over the config's rules, so dense `dot_general`s are quantized where
a rule matches, the routed experts' `gmm` asks for its rule (FP8 with one, plain without), and with
`megablox=false` Qwix quantizes `ragged_dot` itself. Parameters are untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import qwix

from inspect_tool import errors
from inspect_tool import model as model_lib
from inspect_tool import progress
from inspect_tool.checkpoint import exports
from inspect_tool.checkpoint import load_export
from inspect_tool.hf import restore as hf_restore
from inspect_tool.checkpoint import restore
from inspect_tool.configuration import config as config_lib
from inspect_tool.configuration import validation
from inspect_tool.coverage import trace as model_coverage
from inspect_tool.run import batch as batch_lib
from inspect_tool.run import forward as forward_lib
from inspect_tool.run import limits
from inspect_tool.run import weights as weights_lib
from quant import compat
from quant import fp8_providers


def quantize_for_training(model, cfg: config_lib.ModelConfig, rules: Sequence | None = None):
  """The model under a Qwix `QtProvider` with the config's rules (or `rules`); unchanged without any rule."""

  if exports.is_quantized_model(model):
    return model  # an FP8 export under Qwix PTQ: its quantization is in its weights
  rules = model_coverage.config_rules(cfg) if rules is None else list(rules)
  if not rules:
    return model
  args, kwargs = model_lib.qwix_init_inputs(cfg)
  provider = fp8_providers.provider(cfg.quantization, rules)  # QtProvider, or MaxText's NVIDIA / NANOO FP8 one
  return qwix.quantize_model(model, provider, *args, skip_nnx_init=True, **kwargs)


def load_model(cfg: config_lib.ModelConfig, checkpoint: str | weights_lib.Weights | None = None, *, mesh=None):
  """A real model: the checkpoint's weights (straight onto `mesh`'s devices) or a seeded random init; `checkpoint`
  a path, or the `weights.Weights` its command resolved (then read where they were resolved to, not looked up again).

  An FP8 export (`inspect_checkpoint export`) loads into the quantized model (`checkpoint.load_export`): Qwix PTQ for
  dense ops, pre-quantized experts in our gmm.
  """
  weights = weights_lib.resolve(cfg, checkpoint)
  if weights.kind == weights_lib.RANDOM:
    with progress.step(f"initialising {cfg.model_name} (seed {cfg.init_weights_seed})"):
      return model_lib.build_model(cfg, abstract=False)
  if weights.kind == weights_lib.HF:  # bf16 or FP8 DeepSeek safetensors, dequantized to float weights
    with progress.step(f"loading Hugging Face checkpoint {weights.given}"):
      return hf_restore.load_checkpoint(model_lib.build_model(cfg, abstract=True), weights.given, mesh=mesh)
  if weights.kind == weights_lib.EXPORT:
    with progress.step(f"loading {exports.label(weights.given)} {weights.given}"):
      return load_export.load_quantized_model(cfg, weights.given, mesh=mesh)

  with progress.step(f"loading {weights.given}"):
    return restore.load_checkpoint(model_lib.build_model(cfg, abstract=True), weights.resolved, mesh=mesh)


def forward(model, batch: batch_lib.Batch, label: str = "forward pass"):
  """One forward pass on a batch: logits, losses, MTP outputs (`inspect_tool.run.forward.ForwardResult`); `label`
  names it in the progress output."""
  with progress.step(label, plain=True), compat.qwix_weight_detection_errors():
    return forward_lib.run_forward(model, batch.tokens, targets=batch.targets, target_mask=batch.target_mask,
                                   positions=batch.positions, segment_ids=batch.segment_ids)


def grad_step(model, batch: batch_lib.Batch):
  """The jitted training step `loss_and_grad_norm` runs, and its arguments: `(step, params, rest)`.

  `step(params, rest)` returns (total loss (main + λ·MTP), gradients of the Params); `step.lower(params, rest)`
  is what the per-device memory estimate is checked against (XLA's `memory_analysis`)."""

  if exports.is_quantized_model(model):
    raise errors.InputError(f"gradients need float weights; the checkpoint is an "
                            f"{exports.label(getattr(model, exports.MARK))} (use its source)")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, r):
    r = jax.tree.map(lambda a: a, r)  # fresh Variables at this trace level (the model writes non-Param state)
    out = forward_lib.pure_forward(
        graphdef, nnx.merge_state(p, r), jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
        jnp.asarray(batch.segment_ids), jnp.asarray(batch.targets), jnp.asarray(batch.target_mask),
        mtp_scale=model.config.mtp_loss_scaling_factor)
    return out["total_loss"] if "total_loss" in out else out["loss"]

  return jax.jit(jax.value_and_grad(loss_fn)), params, rest


def loss_and_grad_norm(model, batch: batch_lib.Batch) -> tuple[float, float, bool]:
  """Total training loss (main + λ·MTP), the global gradient norm over Params, and whether all grads are finite."""
  step, params, rest = grad_step(model, batch)
  with progress.step("loss and gradients", plain=True):
    loss, grads = step(params, rest)
  leaves = jax.tree.leaves(grads)
  finite = all(bool(jnp.isfinite(g).all()) for g in leaves)
  norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)))
  return float(loss), norm, finite and bool(jnp.isfinite(loss))


@dataclasses.dataclass(frozen=True)
class Run:
  """What `run` computed: the forward result, optionally the unquantized reference and the gradient check."""

  result: object  # inspect_tool.run.forward.ForwardResult
  reference: object | None = None  # the same model and batch without quantization (`compare`)
  grad: tuple[float, float, bool] | None = None  # (loss, global gradient norm, all finite) (`grad`)
  compared: str | None = None  # what `compare` compared, in words


def weights_description(cfg: config_lib.ModelConfig, checkpoint: str | weights_lib.Weights | None) -> str:
  """Which weights a run loads, in words: the checkpoint (Orbax, FP8 export, Hugging Face) or the seeded init."""
  weights = weights_lib.resolve(cfg, checkpoint)
  if weights.kind == weights_lib.RANDOM:
    return f"the random init (seed {cfg.init_weights_seed})"
  if weights.kind == weights_lib.HF:
    return f"the Hugging Face checkpoint {weights.given} (FP8 weights dequantized)"
  if weights.kind == weights_lib.EXPORT:
    return f"the {exports.label(weights.given)} {weights.given}"
  return f"the checkpoint {weights.given}"


def comparison_description(cfg: config_lib.ModelConfig, checkpoint: str | weights_lib.Weights | None) -> str:
  """What `--compare` compares; `InputError` when it would compare a model with itself (no quantization rule)."""
  weights = weights_description(cfg, checkpoint)
  if not model_coverage.config_rules(cfg):
    raise errors.InputError(
        f"--compare runs {weights} under the config's quantization rules against the same weights unquantized; "
        f"quantization={cfg.quantization!r} gives no rule, so both sides would be the same model (set a "
        "quantization such as quantization=fp8_full, or compare two runs' --save-logits)")
  return f"{weights} under quantization={cfg.quantization} (Qwix QT) vs the same weights unquantized"


def run(cfg: config_lib.ModelConfig, batch: batch_lib.Batch, *,
        checkpoint: str | weights_lib.Weights | None = None, mesh=None, compare: bool = False,
        grad: bool = False) -> Run:
  """Forward pass of the configured model (quantized when `quantization` is set), loading the model once;
  `checkpoint` a path or the `weights.Weights` the command resolved."""
  validation.check_runs(cfg, "forward")
  limits.check_memory(cfg, *batch.tokens.shape, grad=grad)
  weights = weights_lib.resolve(cfg, checkpoint)
  compared = comparison_description(cfg, weights) if compare else None
  model = load_model(cfg, weights, mesh=mesh)
  if (compare or grad) and exports.is_quantized_model(model):
    raise errors.InputError(f"--compare and --grad need float weights; {weights.given} is an "
                            f"{exports.label(weights.given)} (its {exports.REPORT_NAME} holds the comparison with its "
                            "source)")
  quantized = quantize_for_training(model, cfg)
  main = "forward pass" if quantized is model else f"forward pass ({cfg.quantization}, Qwix QT)"
  return Run(result=forward(quantized, batch, main),
             reference=forward(model, batch, "forward pass, unquantized (--compare)") if compare else None,
             grad=loss_and_grad_norm(quantized, batch) if grad else None, compared=compared)
