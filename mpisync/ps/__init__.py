"""The parameter-server side: a shard server on every ps rank, the coordinator on one."""
