"""Benchmark: quantized (Qwix QT fp8_full) vs unquantized forward wall time of deepseek3-tiny models.

Run: .venv-py3.12/bin/python bench/bench_forward.py [--runs 5] [--tiny]
Jitted forward of a (2, 16) batch after a warm-up call, median of N; prints the backend (run it on a GPU too).
`--tiny` (a smoke run, seconds): one timed run of the 4-layer model only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from inspect_tool.run import batch
from inspect_tool.configuration import config
from inspect_tool.run import forward
from inspect_tool.run import runner as running

MODELS = {
    "tiny L4 V1024": ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true",
                      "base_num_decoder_layers=4", "first_num_dense_layers=1", "vocab_size=1024"],
    "tiny (stock, 61 layers)": ["model_name=deepseek3-tiny", "mtp_num_layers=1"],
}


def _time(model, data, runs: int) -> float:
  def once():
    out = forward.run_forward(model, data.tokens, targets=data.targets, target_mask=data.target_mask,
                              positions=data.positions, segment_ids=data.segment_ids)
    jax.block_until_ready(out.logits)
  once()  # compile
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    once()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--tiny", action="store_true", help="smoke run: one timed run, the 4-layer model only")
  args = parser.parse_args()
  models = dict(list(MODELS.items())[:1]) if args.tiny else MODELS
  if args.tiny:
    args.runs = 1
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
  print(f"{'model':26s} {'unquantized ms':>15s} {'fp8_full ms':>12s} {'ratio':>6s}")
  for name, tokens in models.items():
    cfg = config.resolve_config(tokens)
    qcfg = config.resolve_config(tokens + ["quantization=fp8_full", "quantize_mtp=true"])
    data = batch.make_batch(batch.fixed_tokens(2, 16, cfg.vocab_size))
    model = running.load_model(cfg)
    plain = _time(model, data, args.runs)
    quantized = _time(running.quantize_for_training(model, qcfg), data, args.runs)
    print(f"{name:26s} {plain * 1e3:15.2f} {quantized * 1e3:12.2f} {quantized / plain:6.2f}")


if __name__ == "__main__":
  main()
