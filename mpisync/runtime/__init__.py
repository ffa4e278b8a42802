"""MPI plumbing both sides use: the poller, guarded communicators, collectives, shared memory,
survival, node discovery and roles, and how a rank ends."""
