"""What runs in a worker process: the generator, scorer and trainer actors, and their parts.

- :mod:`.generator`, :mod:`.scorer`, :mod:`.trainer`: the actors, one a module;
- :mod:`.base`: what every actor has (:class:`~.base.WorkerActor`) and what the generator
  and trainer share (:class:`~.base.PolicyActor`: a policy copy, generation, weights);
- :mod:`.policy`: the model, its LoRA and optimizer on one device;
- :mod:`.store`: what a worker made and still holds (the data plane);
- :mod:`.grads`, :mod:`.fsdp`: summing gradients in a fixed order, sharded trainers.

Each actor wraps a :class:`~digen.runtime.worker.policy.Policy` on its own device
(:mod:`digen.runtime.placement`: ``torch.cuda.set_device`` on a GPU) and knows nothing about
RPC: the actor layer (:mod:`digen.runtime.transport.actors`) calls its methods one at a time. Methods
report the wall-clock span of their own work and the process's peak memory so far
(:class:`~digen.runtime.messages.TimedResult`) so the driver can build the trace and the metrics.

The data plane (:mod:`digen.runtime.worker.store`): ``generate`` keeps the micro-batch's rollout
and pixels in this process and returns only its version; ``score`` (on the
:class:`~.scorer.ScorerActor` beside each generator, its own thread) reads the pixels where they are
(here, or from the trainer that made them, actor to actor); ``update`` takes the
rollout from whichever worker holds it, directly. Between two GPU workers tensors travel
GPU to GPU (device maps); otherwise the sender stages them on the CPU. Every method moves
what it receives onto its own device before using it. The driver passes keys, rewards and
advantages, never tensors.

Weights reach the generators in buckets of at most ``runtime.transport.sync_bucket_mb``: each
generator pulls them from trainer 0 (``weight_sync: rpc``; trainer 0 serves them from its
live parameters, no full copy), or trainer 0 and the generators enter one broadcast per
bucket (``weight_sync: broadcast``; NCCL when every member is on a GPU, else gloo through
the CPU). Where the pools hold different dtypes, weights travel in fp32.

Trainers are data-parallel among themselves over a gloo (CPU) or NCCL (GPU) group built from
an explicit TCP store, so no process-global default group is needed; they sum gradients
with :class:`~digen.runtime.worker.grads.GradAccumulator` (in micro-batch order by default).

Testing aid: with ``DIGEN_TEST_JITTER_S=x`` in a worker's environment, every generate,
score, update and step call first sleeps a random ``0..x`` seconds, so tests can shuffle
the timing of a run and check that its results do not move.
"""
