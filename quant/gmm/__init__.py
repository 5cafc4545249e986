"""The grouped matmul of routed experts: the op, its FP8 path and the kernels that run it."""
