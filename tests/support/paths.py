"""Where the tests find the repository, their worker scripts and these support files, from any folder."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
#: scripts the tests start as processes (torchrun ranks, stuck peers, ...)
WORKERS = TESTS / "workers"
REPO = TESTS.parent
