"""Many processes: JAX's distributed runtime for export, forward and diff."""
