"""A host tier several engines on one node share (``"shared_tier"`` in :mod:`kvshm.vllm`): its
identity, and starting its owner process when an engine finds none.

The owner (``python -m kvshm tier-owner``) keeps the tier's index and makes its arenas, one per
rank; each engine copies its own blocks into and out of them, and asks the owner which chunk
holds what. The first engine that finds no owner starts one, in a session of its own and not as
its child (a launcher starts it and exits), so that it outlives that engine; two engines
starting at once start two, and the control object's ``O_EXCL`` keeps one. The owner exits,
removing the tier, once no engine has been attached for ``idle_exit_s`` seconds.

An owner that dies while engines run leaves its arenas to them (they keep copying into their
mappings); an engine that finds it gone starts another (:class:`OwnerRestart`), which takes over
those arenas as they are and makes none.

An owner started with ``storage`` (``disk:DIR`` or a Redis URL) keeps a storage tier below the
tier: it writes every stored block there too and brings one the arenas evicted back when an
engine asks for it (the engine's lookup answers ``RETRY`` meanwhile); a new owner of the same
blocks finds there what the last one stored.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvshm._kvshm import SegmentError, shared_tier_clients, shared_tier_name, shared_tier_owner

__all__ = [
    "OWNER_START_TIMEOUT_S",
    "OwnerRestart",
    "TierIdentity",
    "ensure_tier_owner",
    "owner_command",
    "owner_log",
    "remove_dead_engine_segments",
    "shared_tier_clients",
    "shared_tier_owner",
    "stop_tier",
    "wait_for_tier_owner",
]

#: The environment variable the owner reads its storage tier from (``kvshm tier-owner``).
STORAGE_ENV = "KVSHM_STORAGE"

#: How long an engine waits for a tier's owner to serve (making a large tier's arenas takes
#: seconds: their memory is zeroed).
OWNER_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TierIdentity:
    """What makes two engines' blocks interchangeable (every field must agree to share)."""

    model: str
    kv_dtype: str
    block_tokens: int
    block_bytes: int
    blocks_per_chunk: int
    layout: str

    def tier_name(self) -> str:
        """The tier's name derived from the identity (``kvshm-tier-MODEL-DIGEST``)."""
        return shared_tier_name(**asdict(self))

    def owner_arguments(self) -> list[str]:
        """The identity as ``tier-owner``'s arguments."""
        return [
            "--model",
            self.model,
            "--kv-dtype",
            self.kv_dtype,
            "--block-tokens",
            str(self.block_tokens),
            "--block-bytes",
            str(self.block_bytes),
            "--blocks-per-chunk",
            str(self.blocks_per_chunk),
            "--layout",
            self.layout,
        ]


def owner_log(tier: str) -> Path:
    """Where a started owner writes its lines (one JSON line per event)."""
    return Path(tempfile.gettempdir()) / f"kvshm-tier-owner-{tier}.log"


def ensure_tier_owner(
    tier: str,
    identity: TierIdentity,
    *,
    chunks: int,
    ranks: int,
    arena_block_bytes: int,
    idle_exit_s: int,
    client_quota: int | None = None,
    storage: str | None = None,
    storage_chunks: int | None = None,
    timeout_s: float = OWNER_START_TIMEOUT_S,
) -> int:
    """The pid of tier ``tier``'s owner, started if none serves it; it serves once this returns
    (its arenas made). An owner started here gives every engine a quota of ``client_quota``
    chunks, if given, and keeps a storage tier below the tier at ``storage`` (``disk:DIR`` or a
    Redis URL; ``storage_chunks`` chunks per rank on disk), if given; one already serving keeps
    its own. Raises ``SegmentError`` when it cannot start (its log says why)."""
    pid = shared_tier_owner(tier)
    if pid is not None:
        return pid
    arenas = ["--chunks", str(chunks), "--arena-block-bytes", str(arena_block_bytes)]
    options = _owner_options(ranks, idle_exit_s, client_quota, storage, storage_chunks)
    for attempt in range(2):
        log_from = _log_size(tier)
        started = _launch_owner(tier, identity, [*arenas, *options], storage)
        try:
            return wait_for_tier_owner(
                tier, timeout_s=timeout_s, started=started, log_from=log_from
            )
        except _OwnerFailed as failed:
            # Another engine's owner won the name and failed on its own options (its storage
            # tier, say): no owner is coming, and this engine's options may do. Once.
            if failed.pid == started or attempt > 0:
                raise
    raise AssertionError("the loop returns or raises")


@dataclass
class OwnerRestart:
    """How an engine starts a new owner for tier ``tier`` when it finds the one it used gone:
    one that takes over the arenas the engines map (``tier-owner --adopt-arenas``), and makes
    none, refusing stores for ``takeover_grace_ms`` (the old owner's stores may still be
    copying). It looks for a live owner at most every ``interval_s`` seconds, twice as long
    after each start that did not bring one (up to 16 times, until it finds one serving); engines
    that try at once start several, and the control object's ``O_EXCL`` keeps one."""

    tier: str
    identity: TierIdentity
    ranks: int
    idle_exit_s: int
    client_quota: int | None = None
    storage: str | None = None
    storage_chunks: int | None = None
    interval_s: float = 5.0
    takeover_grace_ms: int | None = None
    _last_attempt: float | None = field(default=None, init=False, repr=False)
    _starts_unseen: int = field(default=0, init=False, repr=False)

    def poll(self) -> int | None:
        """Starts an owner if none serves the tier and ``interval_s`` has passed since the last
        look; the pid started (it serves shortly after), else ``None``. Raises
        ``SegmentError`` when it cannot be started."""
        now = time.monotonic()
        wait = self.interval_s * 2 ** min(self._starts_unseen, 4)
        if self._last_attempt is not None and now - self._last_attempt < wait:
            return None
        self._last_attempt = now
        if shared_tier_owner(self.tier) is not None:
            self._starts_unseen = 0
            return None
        self._starts_unseen += 1
        grace = self.takeover_grace_ms
        options = [
            "--adopt-arenas",
            *_owner_options(
                self.ranks, self.idle_exit_s, self.client_quota, self.storage, self.storage_chunks
            ),
            *(["--takeover-grace-ms", str(grace)] if grace is not None else []),
        ]
        return _launch_owner(self.tier, self.identity, options, self.storage)


def _owner_options(
    ranks: int,
    idle_exit_s: int,
    client_quota: int | None,
    storage: str | None,
    storage_chunks: int | None,
) -> list[str]:
    options = ["--ranks", str(ranks), "--idle-exit-s", str(idle_exit_s)]
    if client_quota is not None:
        options += ["--client-quota", str(client_quota)]
    # The storage spec itself goes in the owner's environment (_launch_owner).
    if storage is not None:
        options += ["--storage-from-env"]
        if storage_chunks is not None:
            options += ["--storage-chunks", str(storage_chunks)]
    return options


def owner_command(tier: str, identity: TierIdentity, options: list[str]) -> list[str]:
    """The command of an owner of ``tier`` for blocks of ``identity``: ``python -m kvshm
    tier-owner`` with ``options`` (its size, ranks, idle exit, ...)."""
    return [
        sys.executable,
        "-m",
        "kvshm",
        "tier-owner",
        "--name",
        tier,
        *identity.owner_arguments(),
        *options,
    ]


def _launch_owner(
    tier: str, identity: TierIdentity, options: list[str], storage: str | None
) -> int:
    """Starts an owner of ``tier`` (:func:`owner_command`), its output appended to its log, with
    its storage tier ``storage`` in its environment (``KVSHM_STORAGE``): a command line is
    readable by every user of the machine, and a Redis URL may carry a password. Returns the pid
    started."""
    command = owner_command(tier, identity, options)
    env = {name: value for name, value in os.environ.items() if name != STORAGE_ENV}
    if storage is not None:
        env[STORAGE_ENV] = storage
    # Through a launcher that exits at once, so that the owner is no descendant of the engine:
    # an engine that ends kills its process tree (vLLM does), and the owner serves the others.
    log = owner_log(tier)
    try:
        with log.open("ab") as out:
            launched = subprocess.run(
                [sys.executable, "-c", _LAUNCHER, *command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=out,
                check=True,
            )
        return int(launched.stdout)
    except (OSError, ValueError, subprocess.CalledProcessError) as error:
        raise SegmentError(f"the shared tier {tier}'s owner did not start: {error}") from error


#: Starts argv[1:] in a session of its own, its output appended to the file on its stderr, prints
#: its pid, and exits without waiting for it. The owner serves every engine on the node, so it runs
#: on any CPU rather than on its starter's: an engine may be pinned (vLLM's CPU workers are, each
#: to its cores, by its mask and by OpenMP's variables, which a preloaded libgomp obeys in every
#: process that inherits them), and an owner that shares a busy worker's CPU answers late. An
#: operator who wants the owner on chosen CPUs starts it so (``taskset -c ... python -m kvshm
#: tier-owner ...``) before the engines, which then find it serving.
_LAUNCHER = """
import os, subprocess, sys
pinning = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")
env = {name: value for name, value in os.environ.items() if name not in pinning}
try:
    # Every id a CPU may have: the kernel keeps those the machine and the cpuset allow.
    os.sched_setaffinity(0, range(8192))
except OSError as error:
    print(f"kvshm: the owner keeps its starter's CPUs: {error}", file=sys.stderr)
child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=sys.stderr,
                         stderr=sys.stderr, start_new_session=True, env=env)
print(child.pid)
"""


class _OwnerFailed(SegmentError):
    """An owner failed before it served, on its own (not for another owner that won the name):
    no owner of the tier is coming from that start. ``pid`` is that owner's."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


def wait_for_tier_owner(
    tier: str, *, timeout_s: float, started: int | None = None, log_from: int | None = None
) -> int:
    """The pid of tier ``tier``'s owner once one serves it (an owner opens its tier to engines
    once it has set up its arenas, key table and storage tier); ``SegmentError`` past
    ``timeout_s``. With ``started``, the owner this engine launched when ``owner_log(tier)`` held
    ``log_from`` bytes (by default, as many as now), the wait also ends at once when the log says
    that owner failed on its own (a storage tier it cannot open, say), or that the owner which
    held the name failed: no owner is coming from either. An owner that lost the race for the
    name to another says so, and the wait goes on for that one."""
    if log_from is None:
        log_from = _log_size(tier)
    deadline = time.monotonic() + timeout_s
    while True:
        pid = shared_tier_owner(tier)
        if pid is not None:
            return pid
        failure = None if started is None else _owner_failure(tier, log_from, started)
        if failure is not None:
            failed = failure.get("pid")
            raise _OwnerFailed(
                f"the shared tier {tier}'s owner (pid {failed}) did not start: "
                f"{failure.get('failed')} (see {owner_log(tier)})",
                failed if isinstance(failed, int) else None,
            )
        if time.monotonic() >= deadline:
            raise SegmentError(
                f"no owner serves the shared tier {tier} after {timeout_s:.0f} s "
                f"(see {owner_log(tier)})"
            )
        time.sleep(0.02)


def _log_size(tier: str) -> int:
    """The bytes in ``owner_log(tier)`` now (0 if there is none)."""
    try:
        return owner_log(tier).stat().st_size
    except OSError:
        return 0


def _owner_failure(tier: str, log_from: int, started: int) -> dict[str, Any] | None:
    """The first line past byte ``log_from`` of ``owner_log(tier)`` in which owner ``started``
    says it failed on its own, or the owner that held the name says it failed
    (``{"failed": WHY, "another_owner_may_serve": BOOL, "held_the_name": BOOL, ...}``), if
    there is one. Owners of other starts append to the same log: a line not ended yet, or an
    owner's that failed before it took the name, is skipped."""
    try:
        with owner_log(tier).open("rb") as log:
            log.seek(log_from)
            written = log.read()
    except OSError:
        return None
    for line in written.split(b"\n")[:-1]:
        if b'"failed"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        ours = event.get("pid") == started and event.get("another_owner_may_serve") is False
        if ours or event.get("held_the_name") is True:
            return event
    return None


def stop_tier(tier: str, *, timeout_s: float = 10.0) -> None:
    """Ends tier ``tier``: stops its owner (SIGTERM, waiting up to ``timeout_s``), then removes
    its arenas, its key table and its owner's log, and the control object of an owner that
    died (``kvctl cleanup``). For when no engine uses the tier any more: the arenas are what
    running engines copy into."""
    # An owner still setting up too: it would serve arenas removed from under it.
    pid = shared_tier_owner(tier, setting_up=True)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while shared_tier_owner(tier, setting_up=True) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
    if shared_tier_owner(tier, setting_up=True) is None and Path(f"/dev/shm/kvshm.{tier}").exists():
        cleanup = [sys.executable, "-m", "kvshm", "kvctl", "cleanup", tier]
        subprocess.run(cleanup, capture_output=True, check=False)
    for kind in ("host", "keys"):
        for arena in Path("/dev/shm").glob(f"kvshm.{tier}.{kind}.*"):
            arena.unlink(missing_ok=True)
    owner_log(tier).unlink(missing_ok=True)


def remove_dead_engine_segments(prefix: str) -> list[str]:
    """Removes the segments ``<prefix>-<engine>-r<rank>`` (``<engine>`` eight hex digits) of
    engines that died without removing them (killed, crashed) and returns their names. An engine
    on a shared tier names its own segment after its engine id, which vLLM draws anew at every
    start, so no later engine takes a dead one's name over: without this each crash would leave
    its segment in ``/dev/shm`` until ``kvctl cleanup``. The removal is ``kvctl cleanup``'s,
    which takes only segments whose creator is dead, never a running engine's or one being
    created. Never raises: an engine starts whatever it finds."""
    engine_segment = re.compile(re.escape(f"kvshm.{prefix}") + r"-[0-9a-f]{8}-r[0-9]+")
    try:
        objects = [path.name for path in Path("/dev/shm").iterdir()]
    except OSError:
        return []
    candidates = sorted(
        name.removeprefix("kvshm.") for name in objects if engine_segment.fullmatch(name)
    )
    if not candidates:
        return []
    command = [sys.executable, "-m", "kvshm", "kvctl", "cleanup", "--json", *candidates]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        removed = json.loads(done.stdout)["removed"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return []
    return sorted({str(entry["segment"]) for entry in removed})
