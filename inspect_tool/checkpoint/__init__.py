"""Checkpoint I/O: Orbax and safetensors metadata listings, restoring weights into a model, model/checkpoint diff.

Submodules are imported on demand (`from inspect_tool.checkpoint import orbax_metadata`); importing this
package imports neither jax nor orbax.
"""
