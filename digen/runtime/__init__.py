"""The processes of a run, laid out by where they run.

- :mod:`.driver`: the driver process of a disaggregated run: the asyncio loop that admits
  micro-batches and calls the workers (it holds no model);
- :mod:`.worker`: what runs in a worker process: the generator, scorer and trainer actors,
  the policy, the data store, gradient sums, sharding; :mod:`.colocated`: the colocated
  mode's trainer, which samples, scores and trains in each of its processes;
- :mod:`.transport`: how processes start and reach each other (actors over RPC, the fork
  server, process groups, data-parallel ranks, ``torchrun``);
- shared by all: :mod:`.messages` (what crosses between processes), :mod:`.placement`
  (which device each worker gets), :mod:`.metrics` (a step's row of ``metrics.jsonl``),
  :mod:`.notes` (digen's notes in the run's log).

The schedule they follow is :mod:`digen.sched`'s; what a run leaves on disk is written by
:mod:`digen.run` and :mod:`digen.checkpoint`.
"""
