"""A worker's requests to ps 0 (the coordinator), and the answers of the ps ranks."""
from __future__ import annotations

from ..errors import DeadlockError
from ..protocol.wire import Kind, Tag, is_still_question

__all__ = ["PsLink"]


class PsLink:
    """Asks ps 0 for a load, an update, the statistics or the state, and waits for answers.

    Requests travel on the optimizer's own request tag; answers come on its info tag,
    past the coordinator's questions whether this worker is still in a collective among
    the workers (``DenseChannel.answer``).
    """

    def __init__(self, cluster, dense, opt_id: int):
        self.cluster = cluster
        self.dense = dense
        self.info_tag = Tag.of(Tag.INFO, opt_id)
        self.req_tag = Tag.of(Tag.REQ, opt_id)

    def request(self, *req) -> None:
        self.cluster.p2p_comm.send(req, dest=self.cluster.coordinator_rank, tag=self.req_tag)

    def answer(self, source: int, what: str):
        return self.dense.answer(source, what)

    def stats(self) -> dict:
        """The coordinator's step statistics (see ``SyncReplicasOptimizer.stats``)."""
        self.request(Kind.STATS)
        return self.answer(self.cluster.coordinator_rank, "statistics from ps 0")

    def load_answer(self, what: str) -> None:
        """Wait for ps 0's answer to a load or an update: None, or raise the error it sent."""
        err = self.answer(self.cluster.coordinator_rank, f"ps 0's answer to {what}")
        if err is not None:
            raise err

    def from_every_ps(self, kind: Kind, describe: str) -> list:
        """Ask ps 0 for ``kind``; every ps answers with its piece, at one global step."""
        self.request(kind)
        return [self.answer(self.cluster.ps_rank(j), f"{describe} from ps {j}")
                for j in range(self.cluster.num_ps)]

    def park(self, parked: bool, seq: int) -> None:
        """This worker is (no longer) in a collective among the workers: it pushes nothing.

        ``seq``: the number of pushes so far.
        """
        self.request(Kind.PARK if parked else Kind.UNPARK, seq)

    def raise_if_failed(self, call: str) -> None:
        """While in a collective (``call``: ``"worker_comm.allreduce()"``, ...): answer ps
        0's question, or raise what it found."""
        msg = self.cluster.p2p_comm.improbe(source=self.cluster.coordinator_rank,
                                            tag=self.info_tag)
        if msg is None:
            return
        answer = msg.recv()
        if is_still_question(answer):        # yes, still here
            self.request(Kind.STILL, answer[2])
            return
        raise DeadlockError(f"{answer} (this worker is in {call})")
