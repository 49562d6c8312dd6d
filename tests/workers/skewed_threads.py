"""examples/train.py with rank 1 on one more thread than the others: its graph keys differ (torch puts
the thread count in every CPU graph key), so it compiles what rank 0 compiled (a duplicate the report
and ``recipecache explain`` must name)."""

import os
import runpy
import sys
from pathlib import Path

import torch

if os.environ.get("RANK") == "1":
    torch.set_num_threads(torch.get_num_threads() + 1)
example = Path(__file__).resolve().parents[2] / "examples" / "train.py"
sys.argv[0] = str(example)
runpy.run_path(str(example), run_name="__main__")
