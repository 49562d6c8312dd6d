"""What the benchmarks and the tests both need to start jobs: paths, free ports, real Redis servers and clusters,
an environment with the start-up hook installed, the orphan job's kill.

The benchmarks import it from their own folder (a script's folder is first on ``sys.path``); the tests put
``benchmarks/`` on ``sys.path`` (``tests/conftest.py``). No benchmark imports anything under ``tests/``: what only
the tests need stays in ``tests/support``.
"""
