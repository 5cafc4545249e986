"""Pieces of the compiled training step held to the formulas MaxText 0.2.5 states for them, written out here in
NumPy: its learning-rate schedule (linear warm-up, then a cosine to `learning_rate_final_fraction`), Pax's Adam
(`opt_type=adam_pax`: bias-corrected decays), AdamW's decay mask (`xla_compile/optimizers.py`); the main loss's
cross-entropy against one-hot targets and its gradient, softmax - targets (`xla_compile/loss.py`)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inspect_tool.configuration import config
from inspect_tool.xla_compile import build
from inspect_tool.xla_compile import loss
from inspect_tool.xla_compile import optimizers

KEYS = ["model_name=deepseek3-tiny", "learning_rate=0.01", "steps=100", "warmup_steps_fraction=0.2",
        "learning_rate_final_fraction=0.1", "adam_weight_decay=0.1"]


def _cfg(*extra):
  return config.resolve_config(KEYS + list(extra))


def _numpy_schedule(step, peak=0.01, total=100, warmup=20, final=0.001):
  if step < warmup:
    return peak * step / warmup
  pct = (step - warmup) / (total - warmup - 1)
  a = 0.5 * (np.cos(np.pi * pct) + 1)
  return peak * a + final * (1 - a)


@pytest.mark.parametrize("step", [0, 5, 20, 21, 60, 99])
def test_the_schedule_warms_up_linearly_then_follows_maxtexts_cosine(step):
  got = float(optimizers.schedule(_cfg())(jnp.asarray(step)))
  assert got == pytest.approx(_numpy_schedule(step), rel=1e-5, abs=1e-9)


def _numpy_adam_pax(grads_seq, param, lr_seq, b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, wd=0.1):
  mu = np.zeros_like(param)
  nu = np.zeros_like(param)
  updates = []
  for count, (g, lr) in enumerate(zip(grads_seq, lr_seq)):
    t = count + 1.0
    d1 = b1 * (1 - b1 ** (t - 1)) / (1 - b1**t)
    d2 = b2 * (1 - b2 ** (t - 1)) / (1 - b2**t)
    mu = (1 - d1) * g + d1 * mu
    nu = (1 - d2) * g * g + d2 * nu
    u = mu / (np.sqrt(nu + eps_root) + eps) + wd * param
    updates.append(-lr * u)
  return updates, mu, nu


def test_adam_pax_updates_and_moments_follow_pax_bias_corrected_decays():
  cfg = _cfg("adam_b1=0.9", "adam_b2=0.95")
  rng = np.random.default_rng(0)
  param = rng.standard_normal((4, 3)).astype(np.float32)
  grads = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3)]
  tx = optimizers.optimizer(cfg, "adam_pax")
  state = tx.init({"w": jnp.asarray(param)})
  got = []
  for g in grads:
    u, state = tx.update({"w": jnp.asarray(g)}, state, {"w": jnp.asarray(param)})
    got.append(np.asarray(u["w"]))
  lrs = [_numpy_schedule(s) for s in range(3)]
  want, mu, nu = _numpy_adam_pax(grads, param, lrs, b1=0.9, b2=0.95, eps=float(cfg.adam_eps),
                                 eps_root=float(cfg.adam_eps_root))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-12)
  np.testing.assert_allclose(np.asarray(state.mu["w"]), mu, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(state.nu["w"]), nu, rtol=1e-5)
  assert int(state.count) == 3 and state.mu["w"].dtype == jnp.float32


def test_adamw_leaves_the_parameters_its_mask_names_undecayed():
  params = {"decoder": {"w": jnp.ones((2, 2))}, "norm": {"scale": jnp.ones((2,))}}
  grads = jax.tree.map(jnp.zeros_like, params)
  no_warmup = "warmup_steps_fraction=0.0"  # a learning rate from the first step
  masked = optimizers.optimizer(_cfg("adamw_mask=['norm']", no_warmup), "adamw")
  plain = optimizers.optimizer(_cfg(no_warmup), "adamw")
  m, _ = masked.update(grads, masked.init(params), params)
  p, _ = plain.update(grads, plain.init(params), params)
  assert float(jnp.abs(m["norm"]["scale"]).max()) == 0.0  # zero gradient, no decay: no update at all
  np.testing.assert_array_equal(np.asarray(m["decoder"]["w"]), np.asarray(p["decoder"]["w"]))
  assert float(jnp.abs(p["norm"]["scale"]).max()) > 0.0


def test_sgd_keeps_the_schedules_step_count():
  tx = optimizers.optimizer(_cfg(), "sgd")
  state = tx.init({"w": jnp.ones((2,))})
  counts = [leaf for leaf in jax.tree.leaves(state) if leaf.dtype == jnp.int32]
  assert len(counts) == 1
  u, _ = tx.update({"w": jnp.ones((2,))}, state)
  assert float(u["w"][0]) == 0.0  # step 0 of the warm-up: learning rate 0


def test_the_main_loss_and_its_gradient_are_maxtexts_masked_one_hot_cross_entropy():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((2, 5, 11)).astype(np.float32) * 3
  targets = rng.integers(0, 11, (2, 5))
  mask = np.array([[1, 1, 1, 0, 1], [1, 0, 1, 1, 1]], np.int32)
  shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
  probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
  xent = -np.log(np.take_along_axis(probs, targets[..., None], -1))[..., 0]
  want = (xent * mask).sum() / (mask.sum() + 1e-8)
  grad_want = (probs - np.eye(11)[targets]) * mask[..., None] / (mask.sum() + 1e-8)
  value, grad = jax.value_and_grad(lambda *a: loss.main_loss(*a)[0])(jnp.asarray(logits), jnp.asarray(targets),
                                                                      jnp.asarray(mask), 11)
  assert float(value) == pytest.approx(want, rel=1e-6)
  np.testing.assert_allclose(np.asarray(grad), grad_want, rtol=1e-5, atol=1e-7)


def test_the_z_loss_adds_its_term_and_its_factor_to_the_gradient():
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((1, 3, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (1, 3))
  one_hot = np.eye(7, dtype=np.float32)[targets]
  (xent, z_term), vjp = jax.vjp(lambda l: loss.cross_entropy(l, jnp.asarray(one_hot), 0.5), jnp.asarray(logits))
  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  np.testing.assert_allclose(np.asarray(z_term), 0.5 * log_z**2, rtol=1e-5)
  (grad,) = vjp((jnp.ones((1, 3)), jnp.zeros((1, 3))))
  softmax = np.exp(logits - log_z[..., None])
  np.testing.assert_allclose(np.asarray(grad), (1 + 2 * 0.5 * log_z[..., None]) * softmax - one_hot, rtol=1e-5,
                             atol=1e-6)


REMAT_KEYS = ["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=3",
              "first_num_dense_layers=1", "vocab_size=256", "remat_policy=custom", "out_proj=device", "mla_kv=device",
              "moe_mlpwi_1=device"]
# What MaxText 0.2.5's `get_remat_policy` keeps per policy (nnx_decoders.py), for deepseek3-tiny's two MoE layers at
# batch 1 x 16 (H 4, qk 192, v 128, E 64, expert-sorted rows 16 x 8 = 128, shared expert width 64, kv_lora 16):
# the scan's stacked residuals besides the layer input [2, 1, 16, 64].
QKV = [(2, 1, 16, 4, 192), (2, 1, 16, 4, 192), (2, 1, 16, 4, 128)]
TOKENS = (2, 1, 16, 64)
KEPT = {
    "full": [],
    "save_out_proj": [TOKENS],
    "save_qkv_proj": QKV,
    # q, k, v; out_proj; the shared expert's mlpwi_0 and mlpwi_1 (its mlpwo, added to the residual, is no
    # residual of any step of the backward); the routed mlpwi_0 and mlpwo (not its wi_1: MaxText names that one
    # moe_mlpwi_1 only)
    "minimal": QKV + [TOKENS] * 3 + [(2, 128, 64)] * 2,
    "custom": [TOKENS, (2, 1, 16, 16), (2, 128, 64)],  # out_proj, mla_kv, moe_mlpwi_1 on the device
}


def _scan_residuals(policy):
  """The stacked residuals the scanned MoE layers keep for the backward pass under `policy`, as (shape, memory)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool.model import decoder  # pylint: disable=import-outside-toplevel
  cfg = config.resolve_config(REMAT_KEYS)
  graphdef, state = nnx.split(model_lib.build_model(cfg, abstract=False, seed=0).decoder.moe_layers)
  positions = jnp.broadcast_to(jnp.arange(16), (1, 16))

  def run(x, state):
    stack = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    y, _ = decoder.apply_stack(stack, cfg.param_scan_axis, x, None, positions, remat_policy=policy, cfg=cfg)
    return jnp.sum(y.astype(jnp.float32))

  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    jax.ad_checkpoint.print_saved_residuals(run, jnp.ones((1, 16, 64), jnp.bfloat16), state)
  out = []
  for line in printed.getvalue().splitlines():
    found = re.match(r"(\w+)(<host>)?\[([\d,]*)\] output of scan", line)
    if found:
      out.append((tuple(int(d) for d in found.group(3).split(",")), "host" if found.group(2) else "device"))
  return out


@pytest.mark.parametrize("policy", sorted(KEPT))
def test_each_remat_policy_keeps_the_activations_maxtext_names(policy):
  kept = [shape for shape, _ in _scan_residuals(policy)]
  kept.remove(TOKENS)  # the layer input, under every policy
  assert sorted(kept) == sorted(KEPT[policy])


def test_offloading_policies_keep_their_activations_in_host_memory():
  kept = _scan_residuals("qkv_proj_offloaded")
  assert sorted(shape for shape, where in kept if where == "host") == sorted(QKV)
  assert [shape for shape, where in kept if where == "device"] == [TOKENS]


@pytest.mark.parametrize("keys, kernel", [([], "megablox"), (["gmm_backend=pallas"], "pallas"),
                                          (["gmm_backend=xla"], "xla"), (["use_tokamax_backend=true"], "auto")])
def test_the_compiled_step_runs_maxtexts_kernel_unless_the_keys_name_one(keys, kernel):
  """`--compile` compiles the grouped matmul MaxText does (JAX's Megablox, MaxText's kernel's origin) where the keys
  leave it to `auto`; a kernel the keys name, or Tokamax, is kept."""
  cfg = config.resolve_config(["model_name=deepseek3-tiny", *keys])
  assert build.maxtexts_kernel(cfg).gmm_backend == kernel
  assert build.maxtexts_kernel(cfg).use_tokamax_backend == cfg.use_tokamax_backend
