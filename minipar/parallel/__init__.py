"""Parallel training techniques, one file each: data_parallel, zero, tensor_parallel, pipeline, mesh."""
