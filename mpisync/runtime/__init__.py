"""MPI plumbing both sides use: the poller, guarded communicators, collectives, shared memory."""
