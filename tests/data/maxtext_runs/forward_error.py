"""MaxText 0.2.5's forward pass, abstract (jax.eval_shape), on the model of `key=value ...`: prints `OK` or the
frames of MaxText's own code in the traceback and the exception line. Usage (MaxText's venv):
    python forward_error.py key=value ...
"""
import os
import sys
import traceback
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
from flax import nnx
from maxtext.configs import pyconfig
from maxtext.utils.globals import MAXTEXT_PKG_DIR
from maxtext.utils.model_creation_utils import create_nnx_abstract_model
from maxtext.utils import maxtext_utils
argv = [None, os.path.join(MAXTEXT_PKG_DIR, "configs", "base.yml"), *sys.argv[1:], "attention=dot_product",
        "skip_jax_distributed_system=true", "max_target_length=16", "per_device_batch_size=1"]
config = pyconfig.initialize(argv)
mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
_, model = create_nnx_abstract_model(config, mesh=mesh)
graph, state = nnx.split(model)
tok = jnp.zeros((1, 16), jnp.int32)
pos = jnp.broadcast_to(jnp.arange(16), (1, 16))
seg = jnp.ones((1, 16), jnp.int32)
def f(state):
  m = nnx.merge(graph, state)
  return m(tok, pos, decoder_segment_ids=seg, decoder_target_tokens=tok, decoder_target_mask=seg, enable_dropout=False)
print("# " + " ".join(sys.argv[1:]))
try:
  with mesh:
    jax.eval_shape(f, state)
  print("OK")
except Exception as e:  # pylint: disable=broad-except
  for frame in traceback.extract_tb(e.__traceback__):
    if "/maxtext/" in frame.filename:
      print(f"{frame.filename.split('/maxtext/', 1)[1]}:{frame.lineno} {frame.name}: {frame.line}")
  print(f"{type(e).__name__}: {e}")
