"""Planning a run's layout, torch-free: which devices generate and which train, and what
``digen simulate`` reports.

- :mod:`.layouts`: every candidate layout of a set of devices (colocated, and every split
  into generators and trainers under each TAG / TCSS policy) simulated with the same task
  costs and ranked by time and by cost; ``--mode auto`` and ``digen simulate recommend``
  take its first;
- :mod:`.hardware`: what a GPU layout costs beyond the tasks (bytes over links, memory that
  must fit), as explicit formulas;
- :mod:`.simulate`: the comparisons ``digen simulate`` prints and plots (TAG / TCSS
  policies, generators that come and go).

It stands on the scheduling core (:mod:`digen.sched`: the simulator and the TAG policies)
and, like it, never imports torch (``tests/sched/test_torch_free.py``).
"""
