"""``recipecache-run``: torchrun with every rank wired to one shared recipecache store.

:mod:`launcher.main` parses the command line into a :class:`launcher.launch_config.LaunchConfig`,
runs ``python -m torch.distributed.run ... -m launcher.bootstrap script args`` as a child
process, and prints one report for the whole job (:mod:`recipecache.runs.report`). The launcher
itself does not import torch: ``--help`` and bad-input errors stay instant, and a job's ranks start
without waiting for a torch import in the launcher (torchrun's options are read from torch's parser
once per torch installation and kept: :mod:`launcher.torchrun_options`).
"""
