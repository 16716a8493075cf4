"""Scheduling core, torch-free: micro-batches, trace, costs, simulator, TAG/TCSS policies.

Nothing in this package imports torch, so the simulator and the search run (and are tested)
anywhere; ``tests/sched/test_torch_free.py`` guards that.
"""

from digen.sched.costs import Costs, OnlineProfiler
from digen.sched.schedule import Admission, Pool, TaskKind, stale_cap, worker_name
from digen.sched.simulator import SimResult, ideal_bound, simulate
from digen.sched.state import SchedState, WorkerClock
from digen.sched.tag import (
    BTS,
    NoTAG,
    SearchResult,
    StaticTAG,
    TagPolicy,
    brute_force,
    search,
)

__all__ = [
    "BTS",
    "Admission",
    "Costs",
    "NoTAG",
    "OnlineProfiler",
    "Pool",
    "SchedState",
    "SearchResult",
    "SimResult",
    "StaticTAG",
    "TagPolicy",
    "TaskKind",
    "WorkerClock",
    "brute_force",
    "ideal_bound",
    "search",
    "simulate",
    "stale_cap",
    "worker_name",
]
