"""What only the tests share besides fixtures (those are in ``tests/conftest.py``): process helpers, fakes.
``tests/`` is on ``sys.path`` (conftest), so tests import ``support.<module>``; what the benchmarks need too
(paths, ports, real Redis servers) is ``benchmarks/harness``, imported as ``harness.<module>``."""
