"""`matmul_precision` reaches every matmul of the forward pass (attention, MoE, MTP and the head included).

MaxText passes its `matmul_precision` to every dot; on a CPU any precision gives the same float32 products, but a TPU
multiplies float32 at DEFAULT precision in one bf16 pass (tests/test_tpu_chip.py measures it): an op left at the
default would be the one that rounds. The forward's jaxpr (every scan body and custom VJP included) is searched for
dot_generals; each must carry the configured precision. The grouped matmul of the routed experts is a kernel of its
own (a custom VJP: Pallas on TPU, the tiled reference here) that sets the precision of its products itself (bf16
products are exact at any precision; float32 ones HIGHEST): its inside is not searched.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from inspect_tool import model as model_lib
from inspect_tool.configuration import config
from inspect_tool.run import batch as batch_lib
from inspect_tool.run import forward

L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]


def _dots(jaxpr, found):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith("custom_vjp_call"):
      continue
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params.get("precision"))
    for param in eqn.params.values():
      for value in param if isinstance(param, (tuple, list)) else [param]:
        inner = getattr(value, "jaxpr", value)
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          _dots(inner, found)
  return found


@pytest.mark.parametrize("precision", ["high", "highest"])
def test_every_dot_of_the_forward_carries_the_configured_precision(precision):
  cfg = config.resolve_config(L4 + [f"matmul_precision={precision}"])
  graphdef, state = nnx.split(model_lib.build_model(cfg, abstract=False))
  data = batch_lib.make_batch(batch_lib.fixed_tokens(2, 16, 1024))
  tokens, targets = jnp.asarray(data.tokens, jnp.int32), jnp.asarray(data.targets, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens.shape)
  jaxpr = jax.make_jaxpr(lambda s, t, p, y: forward.pure_forward(graphdef, s, t, p, None, y, None, 0.1))(
      state, tokens, positions, targets)
  found = _dots(jaxpr.jaxpr, [])
  want = jax.lax.Precision(precision)
  assert len(found) >= 40  # attention, MLP and experts of 4 layers, MTP, head
  assert all(p is not None and all(x == want for x in p) for p in found), sorted(set(map(str, found)))
