"""Grouped-matmul throughput per backend, bf16 and FP8, at DeepSeek-V3 routed-expert shapes, against the peak.

For every available backend (`quant.gmm.backends`: reference, pallas, xla, tokamax) the same kernel runs the
grouped matmul unquantized on bf16 operands (the baseline) and FP8 (MaxText's fp8_full gmm rule: e4m3
activations per row, e4m3 weights per column, quantized on the fly as in training; e5m2 gradients with --grad).
Shapes: rows = tokens x top-8 sorted by expert over 256 experts, wi (K 7168 -> N 2048) and wo (K 2048 ->
N 7168); group sizes from a seeded random routing. TFLOP/s counts 2*M*K*N per matmul (3 matmuls with --grad);
the ratio to the device's peak uses the dense peak of the dtype (PEAKS; FP8 against the FP8 peak where the
device has FP8 units, else against bf16); speedup = bf16 time / FP8 time of the same kernel. Times: median of
--repeats after --warmup, jitted. Off TPU, pallas is interpret mode (name it with --backends to time it anyway).

  python bench/bench_gmm.py                       # on a GPU or TPU: 4096, 8192, 16384 tokens, every backend
  python bench/bench_gmm.py --grad                # forward + backward
  python bench/bench_gmm.py --small               # CPU: same structure, shapes / 16 and 32 experts
  python bench/bench_gmm.py --backends xla pallas --tokens 4096
  python bench/bench_gmm.py --tiny                # smoke run (seconds): --small, 256 tokens, 1 warmup, 1 repeat
"""

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import qwix

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from quant import errors  # noqa: E402  pylint: disable=wrong-import-position
from quant.gmm import backends as gmm_backends  # noqa: E402  pylint: disable=wrong-import-position
from quant.gmm import fp8 as gmm_fp8  # noqa: E402  pylint: disable=wrong-import-position

FP8_RULE = qwix.QtRule(weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2)
EMB, MLP, EXPERTS, TOP_K = 7168, 2048, 256, 8  # DeepSeek-V3: emb_dim, moe_mlp_dim, num_experts, experts per token
TOKENS = (4096, 8192, 16384)
SMALL = 16  # --small divides K, N and tokens by this and uses 32 experts

# Dense peak TFLOP/s (bf16, fp8; None: no FP8 units) by a substring of jax's device_kind, vendors' data sheets.
PEAKS = (
    ("H200", 989.0, 1979.0), ("H100", 989.0, 1979.0), ("H800", 989.0, 1979.0), ("GH200", 989.0, 1979.0),
    ("B200", 2250.0, 4500.0), ("GB200", 2500.0, 5000.0), ("L40S", 362.0, 733.0), ("A100", 312.0, None),
    ("MI300X", 1307.0, 2615.0), ("MI325X", 1307.0, 2615.0),
    ("TPU v5 lite", 197.0, None), ("TPU v5e", 197.0, None), ("TPU v5", 459.0, None), ("TPU v6", 918.0, None),
    ("TPU7x", 2307.0, 4614.0),
)


def peak(device_kind: str):
  """(bf16, fp8) dense peak TFLOP/s of a device kind, or (None, None) when unknown (CPU)."""
  for key, bf16, fp8 in PEAKS:
    if key.lower() in device_kind.lower():
      return bf16, fp8
  return None, None


def _median_seconds(fn, args, warmup: int, repeats: int) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _op(backend: str, rule, grad: bool):
  def forward(lhs, rhs, groups):
    return gmm_fp8.quantized_gmm(lhs, rhs, groups, rule, jnp.bfloat16, backend=backend)
  if not grad:
    return jax.jit(forward)
  return jax.jit(jax.grad(lambda l, r, g: jnp.sum(forward(l, r, g).astype(jnp.float32)), (0, 1)))


def available_backends(requested) -> list[str]:
  out = []
  for name in requested:
    try:
      out.append(gmm_backends.resolve(name))
    except errors.QuantError as error:
      print(f"  {name}: not available ({error})")
  return list(dict.fromkeys(out))


def _routing(rng, rows: int, experts: int):
  return jnp.asarray(np.bincount(rng.integers(0, experts, rows), minlength=experts), jnp.int32)


def run(backends, tokens, *, small: bool, grad: bool, warmup: int, repeats: int, seed: int) -> None:
  device = jax.devices()[0]
  bf16_peak, fp8_peak = peak(device.device_kind)
  scale = SMALL if small else 1
  emb, mlp, experts = EMB // scale, MLP // scale, EXPERTS // 8 if small else EXPERTS
  print(f"device: {device.platform} ({device.device_kind}), jax {jax.__version__}; peak TFLOP/s bf16 {bf16_peak}, "
        f"fp8 {fp8_peak}; {'fwd+bwd' if grad else 'fwd'}; median of {repeats} after {warmup} warmup")
  print(f"shapes: tokens x top-{TOP_K} rows over {experts} experts, wi K {emb} -> N {mlp}, wo K {mlp} -> N {emb}"
        + (" (--small)" if small else ""))
  names = available_backends(backends)
  print(f"{'backend':10s} {'tokens':>7s} {'matmul':6s} {'bf16 ms':>9s} {'TF/s':>7s} {'%peak':>6s} "
        f"{'fp8 ms':>9s} {'TF/s':>7s} {'%peak':>6s} {'speedup':>8s}")
  rng = np.random.default_rng(seed)
  for count in tokens:
    rows = count // scale * TOP_K
    groups = _routing(rng, rows, experts)
    for name, (k, n) in (("wi", (emb, mlp)), ("wo", (mlp, emb))):
      lhs = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16)
      rhs = jnp.asarray(rng.normal(size=(experts, k, n)) / np.sqrt(k), jnp.bfloat16)
      flops = 2 * rows * k * n * (3 if grad else 1)
      for backend in names:
        row = []
        for rule, top in ((None, bf16_peak), (FP8_RULE, fp8_peak or bf16_peak)):
          seconds = _median_seconds(_op(backend, rule, grad), (lhs, rhs, groups), warmup, repeats)
          tflops = flops / seconds / 1e12
          row.append((seconds, tflops, f"{100 * tflops / top:5.1f}%" if top else "   n/a"))
        (b_s, b_tf, b_pk), (f_s, f_tf, f_pk) = row
        print(f"{backend:10s} {count // scale:7d} {name:6s} {b_s * 1e3:9.2f} {b_tf:7.3g} {b_pk:>6s} "
              f"{f_s * 1e3:9.2f} {f_tf:7.3g} {f_pk:>6s} {b_s / f_s:7.2f}x", flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--backends", nargs="+", choices=gmm_backends.KERNELS, default=None,
                      help="default: every backend available here (pallas only on TPU unless named)")
  parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
  parser.add_argument("--small", action="store_true", help=f"K, N and tokens / {SMALL}, 32 experts (for CPU)")
  parser.add_argument("--grad", action="store_true", help="time forward + backward (3 matmuls)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tiny", action="store_true", help="smoke run: --small, 256 tokens, 1 warmup, 1 repeat")
  args = parser.parse_args(argv)
  if args.tiny:
    args.small, args.tokens, args.warmup, args.repeats = True, [256], 1, 1
  backends = args.backends
  if backends is None:  # Pallas off TPU is interpret mode: a correctness tool, not a kernel to time
    backends = [b for b in gmm_backends.KERNELS if b != "pallas" or jax.default_backend() == "tpu"]
    if jax.default_backend() != "cpu":
      backends = [b for b in backends if b != "reference"]  # a loop of tiles: for CPU only
  run(backends, args.tokens, small=args.small, grad=args.grad, warmup=args.warmup, repeats=args.repeats,
      seed=args.seed)


if __name__ == "__main__":
  main()
