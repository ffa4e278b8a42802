"""The worker's side of one optimizer, opened over the spec every rank agreed on."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..protocol.layouts import layouts_of
from ..protocol.rebuild import settings_of
from ..protocol.routes import ALLREDUCE, REPLICATED
from ..runtime.progress import SETUP_TIMEOUT
from .channels import DenseChannel
from .local import LocalUpdate
from .ps_link import PsLink
from .refusals import check_groups
from .replicated import ReplicatedChannel
from .rows import RowsChannel
from .schedule import Schedules
from .state_io import StateTransfer
from .step_cycle import StepCycle
from .tables_io import TableShards
from .tracking import WriteTracker
from .update_fns import UpdateFunctions

__all__ = ["WorkerParts"]


class WorkerParts:
    """The objects a ``SyncReplicasOptimizer`` hands its work to, set up in order.

    The chief sends the initial parameters and tables to the ps ranks, the workers
    broadcast the parameters they keep (replicated or all-reduced) from the chief; then:
    ``dense`` and ``rows`` (the channels to the ps ranks), ``local`` (the ``LocalUpdate``
    of ``dense="allreduce"``, or None), ``tracker`` (writes between steps), ``link``
    (requests to ps 0), ``tables`` (the resident tables' shards), ``update_fns``,
    ``state_io`` (the state and the moving averages), ``schedules`` and ``cycle`` (the
    step); ``held``, the parameters of each param group at set-up. Call on every worker,
    after the spec was agreed.

    Args:
        spec, routes: what ``agree_spec`` returned.
        model: the worker's ``Model``.
        optimizer: the wrapped torch optimizer; ``groups`` returns the param groups of the
            optimizer that wraps it (the same list).
        schedule: the ``schedule`` option.
    """

    def __init__(self, spec, routes, cluster, model, poller, optimizer: torch.optim.Optimizer,
                 groups: Callable[[], list], schedule: str):
        by_name = dict(model.params)
        self.label = cluster.label
        self.names, self.params = [n for n, _ in model.params], [p for _, p in model.params]
        self.held = [tuple(g["params"]) for g in groups()]    # the ps ranks' set
        self.dense = DenseChannel(spec, layouts_of(spec), cluster, by_name,
                                  dict(model.buffers), poller)
        self.rows = RowsChannel(spec, cluster, by_name, poller)
        with poller.patience(SETUP_TIMEOUT):   # the ps ranks build their side meanwhile
            if cluster.is_chief:
                self.dense.send_initial()
                self.rows.send_initial()
        ReplicatedChannel(cluster.workers_only,
                          [by_name[n] for n in routes.names(REPLICATED) + routes.names(ALLREDUCE)]
                          ).setup()
        # dense="allreduce": the workers average these parameters and apply their step
        self.local = LocalUpdate(spec, cluster, optimizer, groups(), list(model.params),
                                 self.rows) if spec.allreduce else None
        dense = self.dense
        self.tracker = WriteTracker(dense.names, dense.params, dense.pviews, cluster.label,
                                    dense.gviews, dense.staging)
        self.link = PsLink(cluster, dense, spec.opt_id)
        self.tables = TableShards(spec, cluster, self.rows)
        self.update_fns = UpdateFunctions(spec, cluster, self.link, list(model.params),
                                          self.local)
        self.state_io = StateTransfer(spec, routes.plan, cluster, self.link, self.tables,
                                      optimizer, list(model.params), self.local, dense,
                                      self.rows, self.tracker)
        self.schedules = Schedules(schedule, 0)
        self.cycle = StepCycle(spec, cluster, dense, self.rows, self.local, self.tracker,
                               self.schedules, optimizer, groups)
        self.cycle.settings = settings_of(optimizer)

    def check_groups(self, groups: list) -> None:
        """The param groups hold the parameters they held at set-up (the ps ranks' set).

        Raises:
            ConfigError: a parameter was added to or removed from a group, or they moved.
        """
        check_groups(groups, self.held, self.names, self.params, self.label)
