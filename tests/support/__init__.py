"""What the tests share besides fixtures (those are in ``tests/conftest.py``): real servers, process
helpers, paths. ``tests/`` is on ``sys.path`` (conftest), so tests import ``support.<module>``."""
