"""A worker's side of a step: the dense and rows channels, buckets, allreduce, devices."""
