"""How digen's processes start and reach each other.

- :mod:`.actors`: named worker processes holding objects the driver calls by method name,
  over ``torch.distributed.rpc``; only this package touches RPC;
- :mod:`.forkserver`: a warm process that forks the workers (torch and diffusers imported once);
- :mod:`.groups`: torch.distributed process groups and their stores, listening on the run's
  address only; :mod:`.sockets`: the listening sockets under them, and the interface of the
  run's address that the transports bind to;
- :mod:`.join_secret`: the secret a run's joining workers prove they know (the handshake is
  in :mod:`.actors`);
- :mod:`.spawn`: the ranks of a data-parallel colocated run and their group;
- :mod:`.torchrun`: the role and rendezvous of a rank ``torchrun`` started.
"""
