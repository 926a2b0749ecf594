"""Chaos soak harness: the whole stack (beat replicas, workers, stores) under seeded faults.

* ``recorder``  — the Celery app the soak runs: one task that records (entry, slot, token) of
  every run in a separate sink Redis that no fault touches, fenced by the claim token.
* ``stack``     — the processes (beat replicas, workers) and servers of one soak run.
* ``faults``    — the seeded fault injector; every choice is printed so a run can be replayed.
* ``ledger``    — the accounting: slots due, run once, skipped by policy, duplicates,
  unaccounted, failover gaps and recovery times.
* ``run``       — the driver (also ``python -m tests.system.soak.run`` for long soaks).
"""
