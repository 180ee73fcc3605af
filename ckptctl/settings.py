"""Every tunable in one place: piece sizes and thread counts, each with why it has its value.

A leaf module (it imports only ``ckptctl.errors``). The values a user may need to change for
their machine or storage can be set by environment variable; each is read once, at first
import, and parsed strictly: a value that is not a positive integer raises UsageError naming
the variable (the CLI turns it into exit 2), never a silent fallback to the default.

- ``VERIFY_THREADS`` (``CKPTCTL_VERIFY_THREADS``): readers checking checksums (verify, prune)
- ``IO_THREADS`` (``CKPTCTL_IO_THREADS``): readers filling tensors on load and restore
- ``COPY_THREADS`` (``CKPTCTL_COPY_THREADS``): files copied at once (cp, restore)
- ``STREAM_THREADS`` (``CKPTCTL_STREAM_THREADS``): checksum threads of reshard and convert
- ``REQUEST_THREADS`` (``CKPTCTL_REQUEST_THREADS``): small requests in flight at once (ls, du, prune, rm)
- ``WRITE_BEHIND`` (``CKPTCTL_WRITE_BEHIND_MIB``, 0 = off): the POSIX writer's write-behind window
- ``TORCHRUN_TIMEOUT_S`` (``CKPTCTL_TORCHRUN_TIMEOUT``): how long a verb run by torchrun waits for a rank
- ``CLOSE_STORE_TIMEOUT_S`` (``CKPTCTL_CLOSE_STORE_TIMEOUT``): how long ``Checkpointer.close`` tries an
  unreachable c10d store before it takes it as gone
- ``VERIFY_PIECE``, ``STREAM_PIECE``, ``WRITE_PIECE``, ``SEQUENTIAL_RUN``, ``READ_STEP``: bytes
  per read, buffer, write call and sequential run
  (fixed: they trade memory against per-call overhead, not something to tune per machine)
"""

from __future__ import annotations

import os

from ckptctl.errors import UsageError


def env_int(name: str, default: int, *, minimum: int = 1, maximum: int = 1024) -> int:
    """The integer in environment variable ``name``, else ``default``.

    Raises UsageError naming the variable when it is set to anything but an integer in
    ``[minimum, maximum]`` (an empty value counts as unset: ``VAR= ckptctl ...``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise UsageError(
            f"environment variable {name}={raw!r} is not an integer",
            hint=f"set {name} to a whole number from {minimum} to {maximum}, or unset it (default {default})",
        ) from None
    if not minimum <= value <= maximum:
        raise UsageError(
            f"environment variable {name}={value} is outside {minimum}..{maximum}",
            hint=f"set {name} to a whole number from {minimum} to {maximum}, or unset it (default {default})",
        )
    return value


# --- thread counts ---------------------------------------------------------------------------

# Readers verifying one checkpoint, spread over files when there are many and within a file
# when few. Four keep a local NVMe disk or an S3 connection pool busy while hashing stays
# below one core each; more mostly add contention on small machines.
VERIFY_THREADS = env_int("CKPTCTL_VERIFY_THREADS", 4)

# Readers filling tensors when loading: loads read many chunks of many files, mostly small
# ranged reads whose latency (network filesystems, S3) dominates, so more are in flight than
# for verify's large sequential reads.
IO_THREADS = env_int("CKPTCTL_IO_THREADS", 8)

# Files copied at once by cp/restore; each S3 writer adds its own parallel part uploads, so a
# small number already saturates a link.
COPY_THREADS = env_int("CKPTCTL_COPY_THREADS", 4)

# Threads hashing chunks while reshard and convert stream a checkpoint: hashing is the CPU cost
# there, and four match verify so that a reshard checks its source as fast as verify would.
STREAM_THREADS = env_int("CKPTCTL_STREAM_THREADS", 4)

# Small requests in flight at once: a root's checkpoints looked at when a verb lists them all
# (ls, du, prune's survey: each a few small reads, its marker, its manifest, a listing of its
# files), a checkpoint's files deleted once its commit files are gone (a stat and a delete
# each). On object storage or a network filesystem each is a round trip of 15-50 ms: one after
# another, a root of 1,000 checkpoints took minutes to list and a 512-rank checkpoint one to
# delete. Threads mostly wait, so many are cheap.
REQUEST_THREADS = env_int("CKPTCTL_REQUEST_THREADS", 16)

# --- piece sizes (not user settings: they trade memory against call overhead) ----------------

# One verify read: large enough that per-call overhead (an S3 request, a syscall) is noise,
# small enough that VERIFY_THREADS readers, each holding its reads in flight plus one (2
# locally, 9 from S3 by default), stay under 1 GiB of memory (576 MiB from S3).
VERIFY_PIECE = 16 << 20

# One reshard/convert buffer: pieces this small stay in the CPU cache between copying and
# hashing; much larger ones ran several times slower end to end (see docs/decisions.md).
STREAM_PIECE = 4 << 20

# Loads read a local file as long runs, each front to back by one thread in READ_STEP calls:
# the kernel's readahead then fetches ahead of the reader (in large page-cache folios) while it
# copies and hashes each step, still in the CPU's cache. On the 2-core VM (virtual disk, 0.47
# GiB shard, page cache dropped) runs of 60-240 MiB read in 2 MiB steps took 0.5-0.7x the time
# and half the CPU of 16 MiB ranges spread over 8 threads, and 16 MiB runs read in 1 MiB steps
# were no better than the ranges: readahead needs a run long enough to ramp up
# (docs/decisions.md, "Loads read local files as long sequential runs").
SEQUENTIAL_RUN = 64 << 20
READ_STEP = 2 << 20

# One write call of a shard: large sequential writes for throughput; it also bounds how much
# one hash update covers.
WRITE_PIECE = 64 << 20

# Write-behind window of the POSIX writer (``CKPTCTL_WRITE_BEHIND_MIB``, 0 turns it off): every
# window written is handed to the disk at once (sync_file_range), and an older window
# (WRITE_BEHIND_LAG), once on disk, is dropped from the page cache. The final fsync then has little left to flush,
# and a job's page cache does not grow by a checkpoint per save: on the 2-core VM, writes into
# fresh page-cache memory ran 5-10x slower save after save (docs/decisions.md, "Time to
# durable"). Files smaller than one window are left alone (manifests, markers).
WRITE_BEHIND = env_int("CKPTCTL_WRITE_BEHIND_MIB", 32, minimum=0, maximum=4096) << 20
# How many windows behind the newest the writer waits for the disk (then drops the pages): 2
# keeps one window queued beyond the one being written, so writing rarely waits; 1 cost a
# 256 MiB save 10-15% on the development VM (docs/decisions.md, "Time to durable").
WRITE_BEHIND_LAG = 2

# --- torchrun ---------------------------------------------------------------------------------

# How long a verb run by torchrun waits for a rank (``CKPTCTL_TORCHRUN_TIMEOUT``, seconds): to
# start the same command, and, once it did, between two signs of life while others wait for
# it (``ops.rollcall``). Ranks start within seconds of each other and a live rank beats every
# few seconds however long its work takes, so this bounds how late a rank that is gone (killed,
# never started, its host down) is reported, never how long the work may take.
TORCHRUN_TIMEOUT_S = env_int("CKPTCTL_TORCHRUN_TIMEOUT", 300, minimum=1, maximum=24 * 3600)

# --- closing -----------------------------------------------------------------------------------

# How long ``Checkpointer.close`` keeps trying to reach the c10d store once it cannot
# (``CKPTCTL_CLOSE_STORE_TIMEOUT``, seconds), counted from close's start or the first failure,
# whichever is later. While the job runs the tiers' threads retry the store for as long as it
# runs (a blip must not end them); at its end the store may be gone for good (its host, node
# 0's torchrun agent, exited), and close would wait forever. After this long close stops
# waiting for the store, reports what it could not finish (the local tier still holds it) and
# returns. Never a bound on a healthy close: a reachable store is waited for as long as
# ``promote_timeout_s`` and the replica timeout say. 60 s outlasts a store restart or a
# network blip; set it lower where the scheduler kills a job sooner after it ends (Slurm's
# KillWait and Kubernetes' termination grace period are 30 s by default).
CLOSE_STORE_TIMEOUT_S = env_int("CKPTCTL_CLOSE_STORE_TIMEOUT", 60, minimum=1, maximum=24 * 3600)

# --- limits (not user settings: bounds that keep a typo from running away) ------------------

# The most ranks reshard and restore --world-size write shards for: ten times the largest jobs
# run today (about 10^5 GPUs). Beyond it a typo (-w 99999999999999999999) allocated per-rank
# plans until memory ran out, and -w 100000000 would write a hundred million shard files.
# Checkpoints saved by more ranks are still read (the format allows up to 2^24).
MAX_WORLD_SIZE = 1 << 20

# Where each GPU tensor starts in the host staging buffer (``CKPTCTL_STAGING_ALIGN``, bytes, a
# power of two; 1 packs them): slots packed by element size leave device-to-host destinations
# at any even offset, and a copy engine writing to a misaligned destination starts and ends
# with partial transfers. 512 is the minimum CUDA's allocator gives device memory; whether a
# page (4096) copies faster is measured by ``scripts/gpu_smoke.py`` on the first GPU host. The
# padding exists only in host memory: shards on disk stay packed.
STAGING_ALIGN = env_int("CKPTCTL_STAGING_ALIGN", 512, minimum=1, maximum=2 << 20)
if STAGING_ALIGN & (STAGING_ALIGN - 1):
    raise UsageError(
        f"environment variable CKPTCTL_STAGING_ALIGN={STAGING_ALIGN} is not a power of two",
        hint="set CKPTCTL_STAGING_ALIGN to 1, 512, 4096 or another power of two up to 2097152, or unset it (default 512)",
    )
