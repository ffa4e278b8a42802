"""Compiled code beside its loaders: the row kernels, the bulk reads, the build cache."""
