"""Operator tools: the ``recipecache`` command line (:mod:`.cli`), whole-store operations
(:mod:`.admin`), ``recipecache doctor`` (:mod:`.doctor`) and its checks (:mod:`.health`).

They build on the core (the store and its settings); training code never needs them, except
:class:`~.health.HealthCheck`, which the backend interface returns (``Backend.health_checks``).
"""
