"""The options of ``torch.distributed.run`` (torch 2.13) that ``recipecache-run`` passes through.

Kept as a table instead of importing torchrun's parser because importing torch takes
seconds and ``recipecache-run --help`` or a typo should answer at once;
``tests/test_launcher.py`` compares this table with torchrun's own parser so a new
torch version that adds or renames an option fails a test instead of a user's job.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TorchrunOption:
    names: tuple[str, ...]
    takes_value: bool = True

    @property
    def name(self) -> str:
        """The dash spelling, the one passed on to torchrun."""
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.names[-1].lstrip("-").replace("-", "_")


def _option(*names: str, takes_value: bool = True) -> TorchrunOption:
    return TorchrunOption(names, takes_value)


#: Passed through unchanged (``--nproc-per-node`` is handled by the launcher, see --nproc).
PASS_THROUGH: tuple[TorchrunOption, ...] = (
    _option("--nnodes"),
    _option("--rdzv-backend", "--rdzv_backend"),
    _option("--rdzv-endpoint", "--rdzv_endpoint"),
    _option("--rdzv-id", "--rdzv_id"),
    _option("--rdzv-conf", "--rdzv_conf"),
    _option("--standalone", takes_value=False),
    _option("--max-restarts", "--max_restarts"),
    _option("--monitor-interval", "--monitor_interval"),
    _option("--start-method", "--start_method"),
    _option("--event-log-handler", "--event_log_handler"),
    _option("--role"),
    _option("--log-dir", "--log_dir"),
    _option("-r", "--redirects"),
    _option("-t", "--tee"),
    _option("--local-ranks-filter", "--local_ranks_filter"),
    _option("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
    _option("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
    _option("--node-rank", "--node_rank"),
    _option("--master-addr", "--master_addr"),
    _option("--master-port", "--master_port"),
    _option("--local-addr", "--local_addr"),
    _option("--logs-specs", "--logs_specs"),
    _option("--numa-binding", "--numa_binding"),
    _option("--signals-to-handle", "--signals_to_handle"),
    _option("--shutdown-timeout", "--shutdown_timeout"),
    _option("--virtual-local-rank", "--virtual_local_rank", takes_value=False),
)

#: torchrun options that pick how the script is started; the launcher needs that slot
#: for its bootstrap (``-m launcher.bootstrap``), so it refuses them with an explanation.
REFUSED: tuple[TorchrunOption, ...] = (
    _option("-m", "--module", takes_value=False),
    _option("--no-python", "--no_python", takes_value=False),
    _option("--run-path", "--run_path", takes_value=False),
)

#: torchrun's own name for the launcher's ``--nproc``.
NPROC_PER_NODE = _option("--nproc-per-node", "--nproc_per_node")
