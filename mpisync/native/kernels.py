"""The compiled kernels of the ps (``_rows.c``, ``_dense.c``), row and dense, in one namespace.

Row kernels (``rowkernels``): the passes over a table step's taken rows (pooled bag
gradients to rows, the workers' rows merged, the row optimizers' updates) and the tables'
memory. Dense kernels (``densekernels``): the dense step's reduce, alone or with torch
optimizers' steps in the same pass. Each does what the torch code does, with the same
operations in the same order, bitwise. One library holds both (``rowslib``: compiled once
per machine, loaded with ``ctypes``); where there is no compiler, or
``MPISYNC_ROW_KERNELS=0``, ``available()`` is False and the callers use torch.
"""
from __future__ import annotations

from .densekernels import (
    adagrad_exact,
    adagrad_settings,
    adam_exact,
    adam_settings,
    dense_adagrad,
    dense_adam,
    dense_mean,
    dense_rmsprop,
    dense_sgd,
    rmsprop_exact,
    rmsprop_keys,
    rmsprop_settings,
    sgd_exact,
    sgd_settings,
)
from .rowkernels import (
    adagrad_apply_rows,
    adagrad_sum_rows,
    all_below,
    axpy_rows,
    bag_offsets,
    bag_rows,
    bag_sums,
    expand_offsets,
    gather,
    holds_distinct,
    merge_pieces,
    rowwise_rows,
    set_flags,
    shard_order,
    slots_for,
    split_ids,
    table_copy,
    table_zeros,
    unique_inverse,
)
from .rowslib import available

__all__ = [
    "adagrad_apply_rows",
    "adagrad_exact",
    "adagrad_settings",
    "adagrad_sum_rows",
    "adam_exact",
    "adam_settings",
    "all_below",
    "available",
    "axpy_rows",
    "bag_offsets",
    "bag_rows",
    "bag_sums",
    "dense_adagrad",
    "dense_adam",
    "dense_mean",
    "dense_rmsprop",
    "dense_sgd",
    "expand_offsets",
    "gather",
    "holds_distinct",
    "merge_pieces",
    "rmsprop_exact",
    "rmsprop_keys",
    "rmsprop_settings",
    "rowwise_rows",
    "set_flags",
    "sgd_exact",
    "sgd_settings",
    "shard_order",
    "slots_for",
    "split_ids",
    "table_copy",
    "table_zeros",
    "unique_inverse",
]
