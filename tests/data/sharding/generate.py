"""Print MaxText 0.2.5's own sharding of every variable: python generate.py N key=value ..."""
import os
import sys

N = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
overrides = sys.argv[2:]

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.utils import maxtext_utils  # noqa: E402
from maxtext.utils.globals import MAXTEXT_PKG_DIR  # noqa: E402
from maxtext.utils.model_creation_utils import create_nnx_abstract_model  # noqa: E402

argv = [None, os.path.join(MAXTEXT_PKG_DIR, "configs", "base.yml"), *overrides,
        "attention=dot_product", "skip_jax_distributed_system=true"]
config = pyconfig.initialize(argv)
devices_array = maxtext_utils.create_device_mesh(config)
mesh = jax.sharding.Mesh(devices_array, config.mesh_axes)
_, model = create_nnx_abstract_model(config, mesh=mesh)
lines = [f"# mesh {dict(mesh.shape)} devices {N} overrides {' '.join(overrides)}"]
for path, var in nnx.to_flat_state(nnx.state(model)):
  if isinstance(var, nnx.RngState):
    continue
  val = var.get_value()
  sh = val.sharding
  spec = tuple(sh.spec)
  lines.append(f"key: {'.'.join(str(p) for p in path)} | shape: {tuple(val.shape)} | dtype: {val.dtype} | "
               f"spec: P{spec} | shard: {tuple(sh.shard_shape(val.shape))}")
print("\n".join(lines))
