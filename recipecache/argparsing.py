"""argparse as every recipecache command uses it: bad input is one line and exit status 2."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
