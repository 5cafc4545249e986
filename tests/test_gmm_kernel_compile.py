"""Our grouped-matmul kernel compiles for every TPU generation, from any host (libtpu compiles for a topology):
Mosaic refuses a kernel whose tiles overflow a chip's VMEM (v4 has 16 MiB, v5e 128 MiB), so `tiles.auto` fits them
to the chip the program is compiled for. DeepSeek-V3's expert shapes, fp8 operands (the widest VMEM need): forward,
the gradient of the rows (the weight transposed) and the weight's gradient. In a process of its own: libtpu's
environment stays there."""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from quant.gmm import kernel
from quant.gmm import target
from quant.gmm import tiles

from conftest import REPO
COMPILE = """
import sys
import jax, jax.numpy as jnp
from inspect_tool.xla_compile import topology
from quant.gmm import pallas, target
devices = topology.devices(sys.argv[1])
put = jax.sharding.SingleDeviceSharding(devices[0])
S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=put)
m, k, n, g, fp8 = 32768, 7168, 2048, 32, jnp.float8_e4m3fn
with target.compiling_for("tpu", devices[0].device_kind):
  jax.jit(lambda a, b, s, r, c: pallas.matmul(a, b, s, tiling=None, row_scale=r, col_scale=c,
                                              out_dtype=jnp.bfloat16)).lower(
      S((m, k), fp8), S((g, k, n), fp8), S((g,), jnp.int32), S((m, 1), jnp.float32), S((1, n), jnp.float32)).compile()
  jax.jit(lambda a, b, s: pallas.matmul(a, b, s, tiling=None, transpose_rhs=True, out_dtype=jnp.bfloat16)).lower(
      S((m, n), fp8), S((g, k, n), fp8), S((g,), jnp.int32)).compile()
  jax.jit(lambda a, b, s: pallas.outer(a, b, s, tiling=None, out_dtype=jnp.bfloat16)).lower(
      S((m, k), fp8), S((m, n), fp8), S((g,), jnp.int32)).compile()
print("compiled for", devices[0].device_kind)
"""


@pytest.mark.parametrize("topology", ["v4-8", "v5e-1"])
def test_the_kernel_compiles_for_the_chip_s_vmem(topology):
  done = subprocess.run([sys.executable, "-c", COMPILE, topology], capture_output=True, text=True, cwd=REPO,
                        env=dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1"), timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "compiled for TPU v" in done.stdout


def test_auto_keeps_the_measured_tiling_where_vmem_holds_it_and_shrinks_it_on_v4():
  fp8 = (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float32)
  v5e = dict(target.VMEM_BY_KIND)["TPU v5 lite"]
  v4 = dict(target.VMEM_BY_KIND)["TPU v4"]
  assert tiles.auto(65536, 7168, 2048, vmem=v5e, dtypes=fp8) == kernel.Tiling(512, 1024, 2048)
  assert tiles.auto(65536, 2048, 7168, vmem=v5e, dtypes=fp8) == kernel.Tiling(512, 2048, 1024)
  small = tiles.auto(65536, 7168, 2048, vmem=v4, dtypes=fp8)
  assert kernel.footprint(small, *fp8) * 2 <= v4 < kernel.footprint(tiles.MAXTEXT_DEFAULT, *fp8) * 2
