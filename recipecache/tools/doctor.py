"""``recipecache doctor``: is this node set up so that its ranks share compiled artifacts?

Each check is one line (:class:`~recipecache.health.HealthCheck`): the store answers and
keeps what it is given (a round trip of a signed envelope, and a lease), the backend's
own checks (the Redis user's rights and clock, the filesystem store's permissions, free
space and clock), the node tier's directory (private, as ``enable()`` requires), torch's
local cache directory and the Gaudi recipe directory, whether
artifacts are signed, and the inputs of torch's cache keys as this process sees them
(torch version, thread count, compile settings, CPU). Ranks whose key inputs differ
compile the same graph under different keys, so the last line is a digest of them:
run ``recipecache doctor`` on every node and compare.

A malformed URL is bad input (:class:`~recipecache.errors.URLError`, exit 2); a store
that is down or a directory others can write is a failed check (exit 1).

The whole run is bounded: the store's checks run beside the local ones (importing torch takes
seconds) and all of them together get :data:`STORE_CHECKS_BUDGET` per-call timeouts, so a
server that accepts connections and never answers (a stopped process, a half-open path) costs
one bound, said in its line ("no answer within N s"), not a timeout per call.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from .. import env
from ..backends import StoreURL, backend_class
from ..errors import BackendError, ConfigError, URLError, VerificationError, echo
from ..eventlog import EventLog
from ..health import FAIL, PASS, WARN, HealthCheck, free_space, private, writable
from ..keylog import cpu_summary
from ..node_tier import default_node_dir
from ..settings import StoreSettings, check_rank_environment, node_dir, read_secret, resolve_namespace, resolve_url
from ..store_admin import StoreAdmin

#: variables that change torch's cache keys or what it compiles (besides OMP_NUM_THREADS)
KEY_VARIABLE_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_")
#: seconds each of the store's calls waits for an answer (unless the URL sets ``timeout``)
PROBE_TIMEOUT_S = 3.0
#: per-call timeouts all the store's checks together may take (opening the store included): one call that
#: timed out and the rest of the checks; a healthy server answers them in milliseconds
STORE_CHECKS_BUDGET = 2


def run_checks(url: str | None = None, *, namespace: str | None = None) -> list[HealthCheck]:
    """Every check, in the order printed; raises URLError for a malformed ``url``."""
    store = _StoreChecks(url, namespace)
    local = [*_node_checks(), _signing_check(), _settings_check(), *_torch_checks(), *_hpu_checks()]
    return [*store.result(), *local]


class _StoreChecks:
    """The store's checks, run in a thread of their own from construction on, so that they take their time
    beside the local checks' and :meth:`result` can stop waiting for a store that never answers."""

    def __init__(self, url: str | None, namespace: str | None) -> None:
        self._url = StoreURL.parse(resolve_url(url))  # URLError here, as bad input, not from the thread
        backend_class(self._url)  # an unknown scheme too; and the backend's module is imported before the clock runs
        self.budget_s = STORE_CHECKS_BUDGET * (self._url.seconds("timeout", PROBE_TIMEOUT_S) or PROBE_TIMEOUT_S)
        self._deadline = time.monotonic() + self.budget_s
        self._checks: list[HealthCheck] = []
        self._error: BaseException | None = None
        # a daemon: a call blocked on a silent server must not keep the process alive after the result
        self._thread = threading.Thread(target=self._run, args=(namespace,), name="doctor-store", daemon=True)
        self._thread.start()

    def _run(self, namespace: str | None) -> None:
        try:
            self._checks = _store_checks(self._url.raw, namespace)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of result(), which raises it
            self._error = exc

    def result(self) -> list[HealthCheck]:
        """The checks' lines, or one failed line once the budget is spent; raises what the checks raised
        (a malformed URL's URLError, a bad namespace's ConfigError)."""
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._thread.is_alive():
            return [
                HealthCheck(
                    "store",
                    FAIL,
                    f"{echo(self._url.redacted, quote=False)}: no answer within {self.budget_s:g} s (the store's checks together)",
                    "start the server, or correct the URL, password or mount",
                )
            ]
        if self._error is not None:
            raise self._error
        return self._checks


def format_checks(checks: list[HealthCheck]) -> str:
    lines = []
    for check in checks:
        line = f"{check.status.upper():<4}  {check.name:<12} {check.detail}"
        if check.status != PASS and check.fix:
            line += f"; fix: {check.fix}"
        lines.append(line)
    failed = sum(c.failed for c in checks)
    lines.append(f"{len(checks) - failed} of {len(checks)} checks passed" + (f", {failed} failed" if failed else ""))
    return "\n".join(lines)


# -- the store ---------------------------------------------------------------------------
def _store_checks(url: str | None, namespace: str | None) -> list[HealthCheck]:
    try:
        secret = read_secret()
    except ConfigError:
        secret = None  # the signing check reports it
    settings = StoreSettings(url=resolve_url(url), namespace=resolve_namespace(namespace), secret=secret)
    try:
        store = StoreAdmin.open(settings, events=EventLog(None), timeout=PROBE_TIMEOUT_S)
    except URLError:
        raise
    except ConfigError as exc:  # a well-formed URL naming something unusable (a directory others can write)
        return [HealthCheck("store", FAIL, str(exc), "see the message")]
    try:
        probe = f"recipecache-doctor:{secrets.token_hex(8)}"
        round_trip = _round_trip(store, probe)
        if round_trip.failed:
            return [round_trip]
        return [round_trip, _lease_check(store, probe), *store.health_checks(probe)]
    finally:
        store.close()


def _round_trip(store: StoreAdmin, key: str) -> HealthCheck:
    """Write a sealed (and, with a secret, signed) entry, read it back, verify it, delete it."""
    payload = secrets.token_bytes(4096)
    skey = store.storage_key(key)
    start = time.perf_counter()
    try:
        store.write_sealed(key, payload)
        blob = store.read_raw(skey)
        store.delete_raw(skey)
    except BackendError as exc:
        return HealthCheck(
            "store",
            FAIL,
            f"{echo(store.url, quote=False)}: {exc.reason}: {exc}",
            "start the server, or correct the URL, password or mount",
        )
    elapsed_ms = (time.perf_counter() - start) * 1000
    if blob is None:
        return HealthCheck(
            "store",
            FAIL,
            f"{echo(store.url, quote=False)}: an entry written was not there to read back",
            "check for an eviction policy or a full store",
        )
    try:
        read = store.open_entry(key, blob)
    except VerificationError as exc:
        return HealthCheck(
            "store",
            FAIL,
            f"{echo(store.url, quote=False)}: the entry read back failed verification ({exc.reason})",
            "something rewrites values in this store; use another one",
        )
    if bytes(read) != payload:
        return HealthCheck(
            "store", FAIL, f"{echo(store.url, quote=False)}: read back other bytes than written", "use another store"
        )
    return HealthCheck(
        "store", PASS, f"{echo(store.url, quote=False)}: write, read, verify, delete in {elapsed_ms:.1f} ms"
    )


def _lease_check(store: StoreAdmin, key: str) -> HealthCheck:
    try:
        exclusive = store.lease_is_exclusive(key)
    except BackendError as exc:
        return HealthCheck("leases", FAIL, f"{exc.reason}: {exc}", "without leases every rank compiles every graph")
    if not exclusive:
        return HealthCheck(
            "leases",
            FAIL,
            "a lease could not be taken, or was taken twice",
            "the store does not coordinate; check the backend",
        )
    return HealthCheck("leases", PASS, "a lease is taken once and released")


# -- signing and local directories ---------------------------------------------------------
def _node_checks() -> list[HealthCheck]:
    """The node tier's directory: ``$RECIPECACHE_NODE_DIR``, else the one ``recipecache-run`` uses by default.

    ``enable()`` refuses a node directory that is not private (others could plant code
    there), in every rank, so doctor applies the same check: a job that would fail at
    start fails here first.
    """
    path = Path(node_dir() or default_node_dir())
    return [private("node dir", path, "node directory"), free_space("node dir", path)]


def _signing_check() -> HealthCheck:
    try:
        secret = read_secret()
    except ConfigError as exc:
        return HealthCheck("signing", FAIL, str(exc), "fix the key (at least 16 random bytes)")
    if secret is None:
        return HealthCheck(
            "signing",
            WARN,
            f"off: entries are not signed ({env.SECRET_FILE} unset)",
            f"anyone who can write the store runs code on every rank; set {env.SECRET_FILE} "
            "to a file of `openssl rand -hex 32` (chmod 600)",
        )
    source = env.SECRET_FILE if os.environ.get(env.SECRET_FILE) and not os.environ.get(env.SECRET) else env.SECRET
    return HealthCheck("signing", PASS, f"on: keyed BLAKE3 with a {len(secret)}-byte key from {source}")


def _settings_check() -> HealthCheck:
    """What every rank's ``enable()`` reads from the environment (wait timeout, lease TTL, node directory cap,
    CPU fingerprint, exit grace, switches): a value each rank would stop on fails here first."""
    try:
        check_rank_environment()
    except ConfigError as exc:
        return HealthCheck("settings", FAIL, str(exc), "fix or unset it")
    return HealthCheck("settings", PASS, "every RECIPECACHE_ setting a rank reads is valid")


def _hpu_checks() -> list[HealthCheck]:
    """Under Gaudi (``PT_HPU_RECIPE_CACHE_CONFIG`` set), the node's recipe directory: private, with room."""
    from ..hpu.recipe_cache_config import ENV_VAR, parse_config

    if not os.environ.get(ENV_VAR):
        return []
    try:
        recipes = Path(parse_config(os.environ[ENV_VAR]).path)
    except ConfigError as exc:
        return [HealthCheck("hpu recipes", FAIL, str(exc), f"fix {ENV_VAR}")]
    return [private("hpu recipes", recipes, "recipe directory"), free_space("hpu recipes", recipes)]


# -- torch: its local cache and the inputs of its keys -----------------------------------------
def _torch_checks() -> list[HealthCheck]:
    """torch's local cache directory (hits install kernels there) and what enters torch's keys.

    Key inputs as this process sees them: they must be equal on every node, or ranks
    compile the same graphs under different keys.
    """
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith(KEY_VARIABLE_PREFIXES)}
    try:
        import torch
        import torch._inductor.config as inductor_config
        from torch._inductor.runtime.runtime_utils import cache_dir
    except Exception as exc:  # noqa: BLE001 - a broken torch install is a finding, not a crash
        return [HealthCheck("torch", FAIL, f"cannot import torch: {exc!r}", "install torch in this environment")]
    local = Path(cache_dir())
    threads = torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS")
    checks = [
        writable("torch cache", local),
        free_space("torch cache", local),
        HealthCheck("torch", PASS, f"torch {torch.__version__}"),
        *_hook_checks(),
    ]
    if inductor_config.cpp.dynamic_threads or inductor_config.cpp.threads >= 1:
        checks.append(HealthCheck("threads", PASS, f"{threads} threads; kernels do not specialise on the count"))
    elif omp:
        checks.append(
            HealthCheck(
                "threads",
                PASS,
                f"{threads} threads (OMP_NUM_THREADS={omp}); it is in every graph key, so every rank needs the same",
            )
        )
    else:
        checks.append(
            HealthCheck(
                "threads",
                WARN,
                f"{threads} threads: torch's default, the core count, which "
                "differs between node types and is in every graph key",
                "set OMP_NUM_THREADS the same on every node (recipecache-run --threads does)",
            )
        )
    config_digest = _digest(inductor_config.save_config_portable())
    shown = ", ".join(f"{k}={v}" for k, v in settings.items()) or "no TORCHINDUCTOR_/TORCH_COMPILE_ variables"
    checks.append(HealthCheck("compile", PASS, f"{shown}; inductor config digest {config_digest}"))
    cpu = cpu_summary()
    try:
        from ..torch_integration import host_cpu

        in_keys = host_cpu.fingerprint()
    except ConfigError as exc:  # a malformed RECIPECACHE_CPU_FINGERPRINT: enable() would stop on it too
        return [*checks, HealthCheck("cpu", FAIL, str(exc), "fix or unset it")]
    checks.append(
        HealthCheck(
            "cpu",
            PASS,
            f"fingerprint in keys {in_keys}: {cpu['machine']} {cpu['cpu_features']} "
            f"({cpu['cpu_model']}); kernels built for vector features a CPU lacks "
            "do not run on it",
        )
    )
    digest = _digest(
        {"torch": torch.__version__, "threads": threads, "settings": settings, "config": config_digest, "cpu": in_keys}
    )
    checks.append(
        HealthCheck(
            "key inputs",
            PASS,
            f"digest {digest}: run recipecache doctor on every node; equal digests mean equal keys for equal graphs",
        )
    )
    return checks


def _hook_checks() -> list[HealthCheck]:
    """Each torch hook of ``enable()``, on or off on this torch and why (:mod:`recipecache.torch_integration.compat`).

    A hook left off is a warning, not a failure: training runs, without what it gives.
    """
    from ..torch_integration.compat import CHECKED_RELEASES, states

    checks = []
    for state in states():
        hook = state.hook
        if state.on:
            checks.append(HealthCheck("hook", PASS, f"{hook.name} on ({state.why}): {hook.purpose}"))
        else:
            checks.append(
                HealthCheck(
                    "hook",
                    WARN,
                    f"{hook.name} off ({state.why}); lost: {hook.purpose}",
                    f"use a torch release recipecache was checked on ({', '.join(CHECKED_RELEASES)})",
                )
            )
    return checks


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:12]


def exit_status(checks: list[HealthCheck]) -> int:
    """0 when nothing failed (warnings pass), 1 otherwise."""
    return 1 if any(c.failed for c in checks) else 0
