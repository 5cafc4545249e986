"""Model-agnostic quantization pieces: rules, FP8 numerics and the grouped matmul of routed experts.

Submodules are imported on demand (`from quant import gmm`); importing `quant` itself imports no JAX.
"""
