"""Compiled code beside its loaders: the row and dense kernels, the bulk reads, the build cache."""
