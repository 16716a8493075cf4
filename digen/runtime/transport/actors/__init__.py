"""A small actor layer: named worker processes holding objects the driver calls by method name.

The rest of digen sees only :class:`ActorSystem`, :class:`ActorHandle`, :class:`WorkerSpec`
and the errors here; the transport underneath is ``torch.distributed.rpc`` (TensorPipe) and
could be swapped without touching callers. The driver process is rank 0 (``"driver"``) and
runs an asyncio loop; each :class:`WorkerSpec` becomes one spawned process, or, under an
external launcher such as ``torchrun`` (:class:`ExternalLaunch`), one process that someone
else started and that calls :func:`serve_worker`. An elastic system (a dynamic RPC world)
can also start a lost worker again, and take workers that join it while it runs
(:func:`join_world`, :meth:`ActorSystem.next_arrival`): only those that prove they know
its join secret, and they join only a driver that proves it knows it too.

What this layer guarantees, so actor classes need not care:

- one method call at a time per actor, on that actor's own thread, and the driver's calls
  to an actor start in the order they were made (RPC serves requests on a thread pool, so
  calls sent in order would otherwise run concurrently and in any order);
- an exception raised by an actor method reaches the caller as the same object type, with
  the remote traceback attached as a note;
- a dead worker turns every pending and later call to it into :class:`WorkerDied` within
  about a second, and :meth:`ActorSystem.stop` never hangs (RPC's graceful shutdown is a
  barrier that waits forever for a dead peer, so it is not used); with external launch the
  driver has no process to poll, so a transport error followed by an unanswered probe is
  what marks a worker dead, and a worker whose driver stops answering exits by itself;
- only the loopback interface listens when the address is a loopback one;
- when a worker is stopped by the handshake, each of its actors that has a ``close()``
  method gets it called once, on its own thread after its last call (for at most 10 s).

Worker-to-worker calls: an :class:`ActorHandle` pickles to a plain ``(worker, id)`` pair, so
the driver can pass it to an actor, whose method then uses :meth:`ActorHandle.call_sync`;
:func:`run_sync` runs a module-level function in another worker. A chain of synchronous
calls must not lead back to an actor already in it: that actor's thread is the one
waiting, so it would deadlock.

Payload accounting: :attr:`ActorSystem.payload` counts the bytes the driver's calls move,
arguments sent and results received, the tensors (sized as TensorPipe ships them) apart
from the pickled rest. It observes the calls from the event loop thread, after a message
has left, and never stops one.

The layer is five private modules, one layer each, importing only those above them:

- ``_remote``: what runs in every process: the actors' mailboxes and threads, and the
  functions sent by reference over RPC;
- ``_transport``: rendezvous, backend options, the torch-to-asyncio bridge, payload sizing;
- ``_join``: the join secret's handshake between the driver and a joining worker;
- ``_worker``: the worker process (:func:`serve_worker`, :func:`join_world`);
- ``_system``: the driver's view (:class:`ActorSystem`, handles, errors, payload counters).
"""

from digen.runtime.transport.actors._join import JoinRefused
from digen.runtime.transport.actors._system import (
    ActorHandle,
    ActorSystem,
    ActorSystemClosed,
    Arrival,
    ExternalLaunch,
    WorkerDied,
    WorkerSpec,
    active_launch,
    external_launch,
    run_sync,
)
from digen.runtime.transport.actors._worker import (
    exit_with_parent,
    join_world,
    serve_worker,
)

__all__ = [
    "ActorHandle",
    "ActorSystem",
    "ActorSystemClosed",
    "Arrival",
    "ExternalLaunch",
    "JoinRefused",
    "WorkerDied",
    "WorkerSpec",
    "active_launch",
    "exit_with_parent",
    "external_launch",
    "join_world",
    "run_sync",
    "serve_worker",
]
