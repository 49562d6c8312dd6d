"""``recipecache-run``: torchrun with every rank wired to one shared recipecache store.

:mod:`launcher.main` parses the command line into a :class:`launcher.launch_config.LaunchConfig`,
runs ``python -m torch.distributed.run ... -m launcher.bootstrap script args`` as a child
process, and prints one report for the whole job (:mod:`launcher.report`). The launcher
itself never imports torch: ``--help`` and bad-input errors stay instant.
"""
