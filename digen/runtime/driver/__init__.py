"""What runs in the driver process: the one asyncio loop that schedules a disaggregated run.

- :mod:`~digen.runtime.driver.loop`: :class:`Driver`, Algorithm 1's coroutines: each asks
  the scheduler (:class:`~digen.sched.scheduler.Scheduler`) what its worker runs next,
  hands it out and waits for the next.
- :mod:`~digen.runtime.driver.work`: the work handed out (generate, make again, score,
  update): each call's request, and what its answer tells the scheduler; every actor call
  awaited there, told to the scheduler and the accounts; its ``Parts``: what the rooms
  share, made once by the driver; :mod:`~digen.runtime.driver.progress`: what the loops
  wait on.
- :mod:`~digen.runtime.driver.updates`: each scored micro-batch's update (advantages, kept
  rows, holder) until it is trained.
- :mod:`~digen.runtime.driver.step`: the end of each mini-batch and step: the trainers'
  optimizer steps, the weight sync (and the fixed TCSS quota it waits for), a stop asked
  for mid-step.
- :mod:`~digen.runtime.driver.recovery`: a lost generator gone on without: what it held made
  again, what cannot be left out; :mod:`~digen.runtime.driver.pool`: the generator pool's
  membership: losses, restarts, generators that join.
- :mod:`~digen.runtime.driver.evaluation`: evaluation on the generators, outside the
  schedule.
- :mod:`~digen.runtime.driver.handles`: the typed calls each actor takes.
- :mod:`~digen.runtime.driver.cluster`: starts the worker processes and calls their actors.
- :mod:`~digen.runtime.driver.accounting`: a step's book of work done, its costs and trace,
  which becomes the step's metrics row (:mod:`digen.runtime.metrics`, shared with the
  colocated mode).

The driver holds no model: nothing here imports diffusers or peft
(``tests/runtime/test_driver_light.py`` checks). What it exchanges with the workers is in
:mod:`digen.runtime.messages`.
"""
