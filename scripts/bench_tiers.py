#!/usr/bin/env python
"""Tiered checkpointing (local disk + S3) beside its peers, measured in the same run.

    .venv/bin/python scripts/bench_tiers.py [--size-mib 128] [--repeat 3] [--stall-pairs 6]
                                            [--json PATH] [--endpoint-url URL] [--dir PATH]

Starts moto's S3 server on 127.0.0.1 in a process of its own (``bench_s3.start_moto``; or
uses ``--endpoint-url`` / AWS_ENDPOINT_URL for a real store) and builds one flat state of
``--size-mib`` (``bench_save``'s tensors: fp32 and bf16, varied shapes, plus a small tensor
holding the step). Then, every round, in an order that rotates from round to round:

  single    ``Checkpointer(local, retention=KeepLast(2))``: save() stall, save -> wait()
  s3-only   ``Checkpointer("s3://...")``, every save straight to S3 (what tiers replace):
            save() stall, save -> wait()
  tiered    ``Checkpointer(tiers=[Tier(local, KeepLast(2)), Tier(s3, KeepLast(3))])``:
            save() stall, time to durable on tier 1 (save -> wait(), as for the peers; and
            as ``Checkpointer.time_to_durable`` records it) and time to promoted on tier 2
            (from save() start, as ``time_to_durable`` records it); the next section starts
            once the promotion is done
  boto3     ``upload_file`` (s3transfer, its default TransferConfig) of the files of the
            checkpoint just promoted, right after its promotion: the same bytes
  dcp       torch DCP ``async_save`` with one ``DefaultStager`` kept across saves, fsyncing:
            DCP at its best, measured by ``bench_save.Bench.dcp_save`` itself

Before each timed section the run waits until this process and moto's server are idle
(``benchutil.wait_quiet``): what a tool leaves running (the S3 tier's prune, which verifies
the checkpoint just promoted; a local re-read of each shard) is charged to nobody. Round 0
holds the first (cold) saves and is not counted; each figure is the best of the ``--repeat``
rounds after it; each ratio is shown best over best (the verdict) and as the median of the
per-round ratios. Then:

  stalls    ``--stall-pairs`` more single/tiered saves, alternating, for the stall samples
            only: a save's stall is a few ms of memcpy, the figure most exposed to noise

  in flight ``--repeat`` times: a tiered save taken while the promotion of the tiered save
            before it is under way, beside a single-tier save taken under the same promotion
            (info: on a 2-core machine the promoter's checksums and moto compete with the
            stall for the CPUs)
  recovery  ``load_latest`` into a fresh (pre-allocated, zeroed) state, rotating: through a
            fresh tiered Checkpointer all from the local tier (evicted from the page cache
            first); all from S3 (an empty local tier: the local tier deleted, as on a
            replaced node); a single-tier ``Checkpointer(local)``; and boto3
            ``download_file`` of the same S3 objects

Promotion time = tier 2's recorded time minus tier 1's (the copy from
the local tier to S3, every checksum checked on the way, marker last); boto3's upload time of
the same files over it is the promotion throughput vs boto3 (boto3 checks nothing).

Against moto both sides share one Python server, so ratios say more than seconds; and moto
answers a ranged GET in time proportional to the whole object's size (about 45 ms for 1 MiB
of a 64 MiB object, 170 ms of a 256 MiB one, here), which punishes a reader that issues many
ranged GETs of one big shard (``load`` from S3: two per chunk, a verify pass then a read
pass) far more than real S3 would. Hence the 128 MiB default: a few minutes on 2 busy cores.

Checked outside the timings: ``close()`` of the tiered Checkpointer reports the last
checkpoint on both tiers; the newest promoted checkpoint passes ``ckptctl verify s3://...``
(the CLI, run with the same endpoint); every recovery returns the last step, its tensors
equal the saved ones, and the S3 one wrote nothing to its empty local tier. Exit 1 if a
check fails.

Also checked: ``load_latest`` names the local tier first for a step both tiers hold
(``ckptctl.tiers.recovery.committed_across``); it once read such a step from S3.

Then the multi-node rows of issue 23 (``bench_tiers_nodes.py``; ``--skip-nodes`` leaves them
out): 2 torchrun "nodes" x 2 ranks on this host (two launchers, ``--nnodes 2 --node-rank 0/1``,
static rendezvous), each node with its own node-local first tier
(``Tier(node_root, node_local=True)``) and the same S3 tier, ``--size-mib`` in all as
``Shard(0)`` DTensors (each rank saves and loads its own quarter, as under FSDP). One job saves
(one round not counted, then ``--repeat``, each waited for until promoted); a relaunch times
``load_latest`` through fresh Checkpointers, rotating each round, one first load not counted:

  2x2 all-local      both node roots intact (evicted from the page cache first)
  2x2 one node S3    node 1's root moved away (a replaced node's empty disk): its ranks read S3
  2x2 all from S3    both node roots moved away
  2x2 one node peer  with peer replicas (``Tier(..., node_local=True, replicas=1)``, detected
                     at run time: else "n/a (peer replicas not available)"): the replicas=1
                     job's node 1 root moved away. The replicas=1 Checkpointer saves beside a
                     replicas=0 one in the save job, alternating (each save waited for until
                     promoted and replicated): its stall, durable and promoted times over
                     replicas=0's, its time to replicated and the bytes sent to peers per save
                     (``Checkpointer.time_to_replicated``)

A recovery's time is the slowest rank's ``load_latest``; every load's step and every rank's
tensors are checked bitwise against what was saved (the job fails otherwise). Ratios are over
2x2 all-from-S3, in the same run. Also checked: the peer recovery put node 1's own shards back
on its disk (else it read them from S3, and its row would not measure a peer), and each 2x2
``close()`` reports the last step on S3. When the replicas=1 part fails, both jobs run again
without it: the other rows are still measured, the failure is reported and fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from typing import Any, Callable

import torch

from bench_s3 import start_moto
from bench_save import Bench, FlatState, best, build_specs, build_state, same_tensors, zero_tensors
from benchutil import cpu_pressure_us, drop_cache, files_under, free_memory, wait_quiet

MiB = 1 << 20
NA_PEER = "n/a (peer replicas not available)"
NA_SKIPPED = "n/a (--skip-nodes)"

# (key, label, op, bound): ratios with a stated target, PASS/MISS on the median of the
# per-round pairs (best/best when there are none), as bench_save's: one lucky round of either
# tool moves best/best, not the median.
TARGETS = [
    ("stall_vs_single", "tiered stall / single-tier local stall", "<=", 1.05),
    ("promotion_thr_vs_boto3", "promotion throughput / boto3 upload_file", ">=", 1.0),
]
# Same-run ratios without a stated target.
INFO = [
    ("stall_vs_dcp", "tiered stall / DCP* async_save stall"),
    ("durable_tier1_vs_single", "tier-1 time to durable / single-tier durable"),
    ("durable_tier1_vs_dcp", "tier-1 time to durable / DCP* time to durable"),
    ("promoted_tier2_vs_single", "tier-2 time to promoted / single-tier durable"),
    ("promoted_tier2_vs_s3single", "tier-2 time to promoted / S3-only durable"),
    ("stall_vs_s3single", "tiered stall / S3-only Checkpointer stall"),
    ("promotion_time_vs_boto3", "promotion time / boto3 upload_file time"),
    ("stall_inflight_vs_single", "tiered stall, promotion in flight / single"),
    ("recovery_local_vs_s3", "recovery all-local / all-from-S3"),
    ("recovery_local_vs_single", "recovery all-local / single-tier load_latest"),
    ("recovery_s3_thr_vs_boto3", "S3 recovery throughput / boto3 download_file"),
]
# The multi-node rows (2 torchrun nodes x 2 ranks, bench_tiers_nodes.py): shown as the reason
# when not measured (skipped, no peer replicas), and listed under "not_measured" in the JSON.
NODE_ROWS = [
    ("recovery_nodes_local_vs_s3", "recovery all-local / all-from-S3, 2x2 nodes"),
    ("recovery_one_node_s3_vs_s3", "recovery one node from S3 / all-from-S3"),
    ("recovery_one_node_peer_vs_s3", "recovery one node from peer / all-from-S3"),
    ("nodes_stall_replicas_vs_none", "2x2 stall, replicas=1 / replicas=0"),
    ("nodes_durable_replicas_vs_none", "2x2 durable, replicas=1 / replicas=0"),
    ("nodes_promoted_replicas_vs_none", "2x2 promoted, replicas=1 / replicas=0"),
    ("nodes_replicated_vs_promoted", "2x2 time to replicated / to promoted (r=1)"),
]
PEER_ROWS = {"recovery_one_node_peer_vs_s3", "nodes_stall_replicas_vs_none", "nodes_durable_replicas_vs_none",
             "nodes_promoted_replicas_vs_none", "nodes_replicated_vs_promoted"}


def ckptctl_cli() -> list[str]:
    """The installed ``ckptctl`` next to this interpreter (the venv's), else ``-m ckptctl``."""
    exe = os.path.join(os.path.dirname(sys.executable), "ckptctl")
    return [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "ckptctl"]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b) if y]


def nearest_first_ok(roots: list[Any]) -> bool:
    """Whether the library's candidate order names the first tier for a step both tiers hold."""
    from ckptctl.tiers.recovery import committed_across

    return next(iter(committed_across(roots)), (None, ""))[0] == 0


class TierBench:
    """One run: the checkpointers, the samples of each round, the checks."""

    def __init__(self, args: argparse.Namespace, work: str, s3_root: str, endpoint: str,
                 server_pid: int | None) -> None:
        self.args, self.work, self.s3_root, self.endpoint = args, work, s3_root, endpoint
        # Processes whose background work must be over before a timed section: this one (the
        # promoter, the retention threads) and moto's server when this run started it.
        self.quiet_pids = [os.getpid()] + ([server_pid] if server_pid is not None else [])
        self.t_start = time.perf_counter()
        self.kit = FlatState(build_state(build_specs(args.size_mib * MiB, args.tensors)))
        # A small tensor that carries the step: a recovery that loads an older checkpoint than
        # the last one fails the tensor check, not only the step check.
        self.marker = torch.zeros(4, dtype=torch.int64)
        self.kit.state["progress"] = {"step": self.marker}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.kit.tensors())
        self.samples: dict[str, list[float]] = {}
        self.checks: dict[str, bool] = {}  # every one must be True
        self.details: dict[str, Any] = {}  # what the checks looked at
        self.notes: list[str] = []  # printed under the figures
        self.quiet_waited = 0.0
        self.step = 0
        self.single_root = os.path.join(work, "single")
        self.tier1_root = os.path.join(work, "tier1")
        self.tier2_url = f"{s3_root}/tiered"
        from ckptctl.storage import open_storage

        # The keys time_to_durable() records each tier under.
        self.tier1_key, self.tier2_key = open_storage(self.tier1_root).url, open_storage(self.tier2_url).url
        import boto3
        from boto3.s3.transfer import TransferConfig

        self.s3 = boto3.client("s3", endpoint_url=endpoint)
        self.bucket, _, self.prefix = s3_root[len("s3://"):].partition("/")
        self.boto_cfg = TransferConfig()  # boto3's defaults: 8 MiB threshold and chunks, 10 threads
        self.last_promoted: tuple[int, str] | None = None  # (step, checkpoint name) on tier 2
        self.nodes_na: dict[str, str] = {}  # multi-node rows not measured: why

    # --- helpers ------------------------------------------------------------------------------

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def progress(self, what: str) -> None:
        print(f"[bench] {what} ({time.perf_counter() - self.t_start:.0f}s)", file=sys.stderr)

    def quiet(self) -> None:
        """Before each timed section: what the last tool left running in the background (the
        S3 tier's prune verifying the checkpoint just promoted, a local re-read, moto still
        busy) is over, so it is charged to nobody."""
        self.quiet_waited += wait_quiet(self.quiet_pids)

    def next_step(self) -> int:
        self.step += 1
        self.marker.fill_(self.step)
        return self.step

    def wait_promoted(self, ck: Any, step: int) -> dict[str, float]:
        """Block until ``step`` is on tier 2; its times to durable per tier. Polling costs no
        accuracy: the promoter records the time itself, the moment the marker is written."""
        deadline = time.monotonic() + self.args.promote_timeout
        while True:
            got = ck.time_to_durable(step)
            if self.tier2_key in got:
                return got
            if time.monotonic() > deadline:
                raise SystemExit(f"step {step} not promoted to {self.tier2_key} within "
                                 f"{self.args.promote_timeout:.0f} s (reached: {sorted(got)})")
            time.sleep(0.005)

    # --- the tools, one save each -------------------------------------------------------------

    def single_save(self, ck: Any, counted: bool, key: str = "single") -> None:
        step = self.next_step()
        self.quiet()
        t0 = time.perf_counter()
        h = ck.save(step, self.kit.ck_state())
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        if counted:
            self.add(f"{key}_stall_s", t1 - t0)
            self.add(f"{key}_durable_s", t2 - t0)

    def tiered_save(self, ck: Any, counted: bool) -> None:
        step = self.next_step()
        self.quiet()
        t0 = time.perf_counter()
        h = ck.save(step, self.kit.ck_state())
        t1 = time.perf_counter()
        url = h.wait()
        t2 = time.perf_counter()
        if url is None:
            raise SystemExit(f"tiered save of step {step} returned no URL")
        name = url.rstrip("/").rsplit("/", 1)[-1]
        got = self.wait_promoted(ck, step)
        self.last_promoted = (step, name)
        if counted:
            self.add("tiered_stall_s", t1 - t0)
            # Durable on tier 1 as for the single-tier peer (save -> wait() return), and as the
            # library records it (time_to_durable; with retention on tier 1 it lands after the
            # re-read of the shard that retention relies on, later than wait() returns).
            self.add("tier1_durable_s", t2 - t0)
            self.add("tier1_recorded_s", got[self.tier1_key])
            self.add("tier2_promoted_s", got[self.tier2_key])
            # The promoter is offered the checkpoint when tier 1's time is recorded: from then on
            # the time is the copy's.
            self.add("promotion_s", got[self.tier2_key] - got[self.tier1_key])
            # Right after its promotion, boto3 uploads the same files (the same bytes).
            self.boto_upload(os.path.join(self.tier1_root, name))

    def boto_upload(self, src: str) -> None:
        files = sorted(files_under(src))
        dest = f"{self.prefix}/boto-up-{uuid.uuid4().hex[:6]}"
        self.quiet()
        t0 = time.perf_counter()
        for f in files:
            self.s3.upload_file(f, self.bucket, f"{dest}/{os.path.relpath(f, src)}", Config=self.boto_cfg)
        self.add("boto3_upload_s", time.perf_counter() - t0)
        # Outside the timing: moto keeps every object in memory.
        for f in files:
            self.s3.delete_object(Bucket=self.bucket, Key=f"{dest}/{os.path.relpath(f, src)}")

    def dcp_save(self, bench: Bench, r: int, counted: bool) -> None:
        self.next_step()  # the marker changes as for the other tools
        self.quiet()
        bench.dcp_save(r, "dcp_cached")  # bench_save's own measurement of DCP at its best
        rec = bench.res["dcp_cached"]
        if counted:
            self.add("dcp_stall_s", rec["stall_s"][-1])
            self.add("dcp_durable_s", rec["stall_s"][-1] + rec["bg_s"][-1])

    # --- phases -------------------------------------------------------------------------------

    def save_rounds(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from ckptctl import Checkpointer, KeepLast, Tier

        bench = Bench(self.kit, self.nbytes, self.work, self.args.repeat, set(), sys.stderr, self.t_start)
        # As bench_save.Bench.save_rounds sets it up: one stager kept across saves (reused host
        # copies), synchronous staging (async_save returns after the copy, as save() does).
        bench._stager = DefaultStager(StagingOptions(False, False, False, False))
        # The same local retention on both, so that the comparison isolates the tiers.
        single = Checkpointer(self.single_root, retention=KeepLast(2))
        # Every save straight to S3, what tiers replace: no retention, whose re-read of each
        # shard would come from S3 (a handful of 256 MiB checkpoints fit in moto's memory).
        s3_single = Checkpointer(f"{self.s3_root}/single")
        tiered = Checkpointer(tiers=[Tier(self.tier1_root, retention=KeepLast(2)),
                                     Tier(self.tier2_url, retention=KeepLast(3))])
        flushed = None
        try:
            for r in range(1 + self.args.repeat):
                self.progress(f"save round {r}" + (" (first saves, not counted)" if r == 0 else ""))
                counted = r > 0
                steps: list[Callable[[], None]] = [
                    lambda: self.single_save(single, counted),
                    lambda: self.single_save(s3_single, counted, key="s3single"),
                    lambda: self.tiered_save(tiered, counted),
                    lambda: self.dcp_save(bench, r, counted),
                ]
                for fn in steps[r % len(steps):] + steps[: r % len(steps)]:  # who goes first rotates
                    fn()
            self.stall_pairs(single, tiered)
            self.inflight_rounds(single, tiered)
        finally:
            single.close()
            s3_single.close()
            flushed = tiered.close(promote_timeout_s=self.args.promote_timeout)
            bench._stager.close()
            bench.keep_newest("dcp_cached", None)
        # close() owes the last checkpoint on the last tier (it is there already: waited for).
        self.checks["close_flushed"] = flushed is not None and bool(flushed) and \
            self.last_promoted is not None and flushed.step == self.last_promoted[0]
        self.details["close_tiers"] = list(flushed.tiers) if flushed is not None else []

    def stall_pairs(self, single: Any, tiered: Any) -> None:
        """More stall samples, the figure most exposed to noise (a few ms of memcpy on a shared
        machine): ``--stall-pairs`` more saves of each, alternating, each with its background
        work (the tiered one's promotion) over before the next. They join the rounds' samples
        (both lists grow by one per pair, so the per-round ratios stay paired)."""
        for r in range(self.args.stall_pairs):
            if r % 4 == 0:
                self.progress(f"stall pairs {r + 1}-{min(r + 4, self.args.stall_pairs)}")
            stalls: dict[str, float] = {}
            pair = [(single, "single"), (tiered, "tiered")]
            for ck, key in pair if r % 2 == 0 else pair[::-1]:
                step = self.next_step()
                self.quiet()
                t0 = time.perf_counter()
                h = ck.save(step, self.kit.ck_state())
                stalls[key] = time.perf_counter() - t0
                url = h.wait()
                if url is None:
                    raise SystemExit(f"save of step {step} returned no URL")
                if key == "tiered":
                    self.wait_promoted(ck, step)
                    self.last_promoted = (step, url.rstrip("/").rsplit("/", 1)[-1])
            for key, v in stalls.items():
                self.add(f"{key}_stall_s", v)

    def inflight_rounds(self, single: Any, tiered: Any) -> None:
        """Stalls while a promotion is under way: a tiered save A commits, and while A is being
        promoted a tiered save B and a single-tier save are taken (order alternating by round,
        each waited for before the other: both stalls see A's promotion and nothing else)."""
        self.samples.setdefault("inflight_stall_s", [])
        self.samples.setdefault("inflight_single_stall_s", [])
        for r in range(self.args.repeat):
            self.progress(f"in-flight round {r}")
            a = self.next_step()
            self.quiet()
            if tiered.save(a, self.kit.ck_state()).wait() is None:
                raise SystemExit(f"tiered save of step {a} returned no URL")
            stalls: dict[str, float] = {}
            urls: dict[str, tuple[int, str]] = {}
            busy = True  # A's promotion ran all through both stalls
            pair = [(tiered, "inflight_stall_s"), (single, "inflight_single_stall_s")]
            for ck, key in pair if r % 2 == 0 else pair[::-1]:
                step = self.next_step()
                t0 = time.perf_counter()
                h = ck.save(step, self.kit.ck_state())
                stalls[key] = time.perf_counter() - t0
                busy = busy and self.tier2_key not in tiered.time_to_durable(a)
                url = h.wait()
                if url is None:
                    raise SystemExit(f"save of step {step} returned no URL")
                urls[key] = (step, url.rstrip("/").rsplit("/", 1)[-1])
            b = urls["inflight_stall_s"]
            self.wait_promoted(tiered, b[0])
            self.last_promoted = b
            if busy:
                for key, v in stalls.items():
                    self.add(key, v)
            else:  # at a tiny --size-mib a promotion can end that fast
                self.details["inflight_pairs_dropped"] = self.details.get("inflight_pairs_dropped", 0) + 1
                self.progress("  the promotion ended before both saves did: pair dropped")

    def recovery_rounds(self) -> None:
        from ckptctl import Checkpointer, Tier
        from ckptctl.storage import open_storage

        assert self.last_promoted is not None
        last, name = self.last_promoted  # the newest tiered checkpoint, on both tiers
        self.marker.fill_(last)  # the live state as it was saved at that step
        target = self.kit.target()  # pre-allocated and touched, like a live model
        want = self.kit.tensors()
        self.details["recovered_step_expected"] = last
        self.checks["load_latest_nearest_tier_first"] = nearest_first_ok(
            [open_storage(self.tier1_root), open_storage(self.tier2_url)])
        boto_dst = os.path.join(self.work, "boto-download")
        s3_files = [o["Key"] for o in self.s3.list_objects_v2(
            Bucket=self.bucket, Prefix=f"{self.prefix}/tiered/{name}/").get("Contents", [])]

        def recover(kind: str, r: int) -> None:
            if kind == "boto3":  # the same objects, downloaded by boto3's transfer manager
                os.makedirs(boto_dst, exist_ok=True)
                self.quiet()
                t0 = time.perf_counter()
                for i, key in enumerate(s3_files):
                    self.s3.download_file(self.bucket, key, os.path.join(boto_dst, str(i)), Config=self.boto_cfg)
                self.add("boto3_download_s", time.perf_counter() - t0)
                shutil.rmtree(boto_dst)
                return
            zero_tensors(target.tensors())
            if kind == "s3":  # the local tier deleted: a replaced node's empty disk
                first = os.path.join(self.work, f"empty-{r}")
                os.makedirs(first)
            else:
                first = self.tier1_root
                drop_cache(first)  # cold: a relaunch after a crash does not find it cached
            ck = Checkpointer(first) if kind == "single" else Checkpointer(tiers=[Tier(first), Tier(self.tier2_url)])
            try:
                self.quiet()
                t0 = time.perf_counter()
                step = ck.load_latest(target.ck_state(), prepare=False)
                seconds = time.perf_counter() - t0
            finally:
                ck.close()
            self.add(f"recovery_{kind}_s", seconds)
            ok = step == last and same_tensors(want, target.tensors())
            if kind == "s3":
                ok = ok and not os.listdir(first)  # nothing local: every byte came from S3
            self.checks[f"recovery_{kind}_correct"] = self.checks.get(f"recovery_{kind}_correct", True) and ok
            if not ok:
                self.progress(f"  recovery ({kind}): step {step} (want {last}), or tensors differ, or wrong tier")

        kinds = ["local", "s3", "single", "boto3"]
        for r in range(self.args.repeat):
            self.progress(f"recovery round {r}")
            for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:  # who goes first rotates
                recover(kind, r)
        del target
        free_memory()

    def nodes_rounds(self) -> None:
        """The multi-node rows: two jobs of 2 torchrun nodes x 2 ranks (``bench_tiers_nodes``).
        With peer replicas available the replicas=1 Checkpointer runs in them too; when that
        part fails, the jobs run again without it (the other rows still measured) and the
        failure is a failed check, reported."""
        import bench_tiers_nodes as bn

        self.nodes_na = {}
        if self.args.skip_nodes:
            self.nodes_na = {k: NA_SKIPPED for k, _ in NODE_ROWS}
            return
        why = bn.replicas_supported()
        self.details["nodes_peer_replicas"] = "available" if why is None else why
        self.quiet()  # moto idle: what the single-process part left is charged to nobody
        work = os.path.join(self.work, "nodes")
        runs = [True, False] if why is None else [False]
        for i, peer in enumerate(runs):
            try:  # a second try gets roots and an S3 prefix of its own
                got = bn.run_nodes(f"{work}{i or ''}", f"{self.s3_root}{'/again' if i else ''}", self.args.size_mib,
                                   self.args.tensors, self.args.repeat, peer, self.args.promote_timeout,
                                   progress=self.progress, quiet_pids=self.quiet_pids[1:])
                break
            except bn.NodeJobError as e:
                self.progress(f"2x2 nodes ({'with' if peer else 'without'} peer replicas) FAILED:\n{e}")
                key = "nodes_peer_ran" if peer else "nodes_ran"
                self.checks[key] = False
                self.details[key + "_error"] = str(e)
        else:
            self.nodes_na = {k: "n/a (the 2x2 job failed: see above)" for k, _ in NODE_ROWS}
            return
        if not peer:
            self.nodes_na = {k: NA_PEER if why is not None else "n/a (the replicas=1 job failed: see above)"
                             for k in PEER_ROWS}
        saved, rec = got["save"], got["recover"]
        self.quiet_waited += saved.get("quiet_waited_s", 0.0) + rec.get("quiet_waited_s", 0.0)
        self.details["nodes_phases_s"] = {"save": saved.get("phases_s"), "recover": rec.get("phases_s")}
        logged = saved.get("log_lines", []) + rec.get("log_lines", [])
        self.details["nodes_logged"] = logged
        if logged:
            self.notes.append(f"the 2x2 ranks logged {len(logged)} line(s) (JSON details.nodes_logged), first: {logged[0][:160]}")
        replica_bytes = saved["samples"].pop("peer_replica_bytes", None)  # bytes, not seconds
        for k, v in saved["samples"].items():
            self.samples[f"nodes_{k}"] = v
        for k, v in rec["samples"].items():
            if not k.endswith("_ranks_s"):
                self.samples[f"nodes_{k}"] = v
        self.details["nodes_recovery_per_rank_s"] = {k: v for k, v in rec["samples"].items() if k.endswith("_ranks_s")}
        for k, v in rec["checks"].items():
            self.checks[f"nodes_{k}"] = v
        for kind, f in saved["flushed"].items():
            self.checks[f"nodes_{kind}_close_flushed"] = bool(f["complete"]) and f["step"] == saved["last"]
        self.details["nodes_manifest_stats"] = saved["manifest_stats"]
        wrote = rec["wrote_to_empty_root"]
        self.details["nodes_wrote_to_empty_root"] = wrote
        from_s3 = {k: v for k, v in wrote.items() if k != "one_node_peer"}
        if from_s3:  # informative: a recovery from S3 needs to write nothing locally
            self.notes.append(f"note: a 2x2 recovery from S3 left files in a replaced node's empty root: {from_s3}")
        if peer:
            # From the peer: node 1 gets its own ranks' shards back on its disk, from its partner.
            mine = [f for f in wrote.get("one_node_peer", {}).get("node1", []) if not f.startswith(".")]
            self.checks["nodes_peer_restored_node1_shards"] = all(
                any(f"rank-{k:05d}-of-" in f for f in mine) for k in (2, 3))
            self.details["nodes_replica_bytes"] = replica_bytes
            if replica_bytes:
                self.notes.append(
                    f"2x2 replicas=1: {statistics.median(replica_bytes) / MiB:.1f} MiB sent to peers per save "
                    f"(median; {statistics.median(replica_bytes) / self.nodes_bytes(saved):.2f} x the checkpoint)")
            self.peer_extras(saved["manifest_stats"])

    @staticmethod
    def nodes_bytes(saved: dict) -> float:
        """The 2x2 checkpoint's bytes, as its manifests record them."""
        b = [d.get("bytes") for d in saved["manifest_stats"].get("plain", []) if d.get("bytes")]
        return float(b[-1]) if b else float("nan")

    def peer_extras(self, stats: dict[str, list[dict]]) -> None:
        """What the replicas=1 saves' manifests record beyond the replicas=0 ones' (the replica
        copies: bytes sent, seconds), best and median over the counted rounds."""
        plain = {k for d in stats.get("plain", []) for k in d}
        extra: dict[str, list[float]] = {}
        for d in stats.get("peer", []):
            for k, v in d.items():
                if k not in plain or "replica" in k or "peer" in k:
                    extra.setdefault(k, []).append(v)
        self.details["nodes_replica_stats"] = extra
        if extra:
            self.notes.append("2x2 replicas=1 manifests record (median over rounds): " + ", ".join(
                f"{k} {statistics.median(v):.4g}" for k, v in sorted(extra.items())))

    def verify_promoted(self) -> None:
        """``ckptctl verify`` of the newest promoted checkpoint, through the CLI, as a user would."""
        assert self.last_promoted is not None
        url = f"{self.tier2_url}/{self.last_promoted[1]}"
        env = {**os.environ, "AWS_ENDPOINT_URL": self.endpoint}
        r = subprocess.run([*ckptctl_cli(), "verify", "--quiet", url], env=env, capture_output=True, text=True,
                           timeout=600)
        self.checks["verify_promoted"] = r.returncode == 0
        self.details["verify_promoted_url"] = url
        if r.returncode != 0:
            self.progress(f"ckptctl verify {url} failed (exit {r.returncode}): {r.stdout}{r.stderr}")

    # --- figures ------------------------------------------------------------------------------

    def figures(self) -> tuple[dict[str, float | None], dict[str, dict[str, Any]]]:
        s = self.samples
        b = {k: best(v) for k, v in s.items()}
        figs = {k[: -len("_s")] + "_best_s": v for k, v in b.items()}

        def rat(num: str, den: str, invert: bool = False) -> dict[str, Any]:
            a, d = (den, num) if invert else (num, den)
            pr = paired(s.get(a, []), s.get(d, []))
            return {"best": ratio(b.get(a), b.get(d)), "median": statistics.median(pr) if pr else None, "paired": pr}

        rats = {
            "stall_vs_single": rat("tiered_stall_s", "single_stall_s"),
            "stall_vs_dcp": rat("tiered_stall_s", "dcp_stall_s"),
            "durable_tier1_vs_single": rat("tier1_durable_s", "single_durable_s"),
            "durable_tier1_vs_dcp": rat("tier1_durable_s", "dcp_durable_s"),
            "promoted_tier2_vs_single": rat("tier2_promoted_s", "single_durable_s"),
            "promoted_tier2_vs_s3single": rat("tier2_promoted_s", "s3single_durable_s"),
            "stall_vs_s3single": rat("tiered_stall_s", "s3single_stall_s"),
            "promotion_time_vs_boto3": rat("promotion_s", "boto3_upload_s"),
            "promotion_thr_vs_boto3": rat("promotion_s", "boto3_upload_s", invert=True),
            "stall_inflight_vs_single": rat("inflight_stall_s", "inflight_single_stall_s"),
            "recovery_local_vs_s3": rat("recovery_local_s", "recovery_s3_s"),
            "recovery_local_vs_single": rat("recovery_local_s", "recovery_single_s"),
            "recovery_s3_thr_vs_boto3": rat("recovery_s3_s", "boto3_download_s", invert=True),
            "recovery_nodes_local_vs_s3": rat("nodes_recovery_all_local_s", "nodes_recovery_all_s3_s"),
            "recovery_one_node_s3_vs_s3": rat("nodes_recovery_one_node_s3_s", "nodes_recovery_all_s3_s"),
            "recovery_one_node_peer_vs_s3": rat("nodes_recovery_one_node_peer_s", "nodes_recovery_all_s3_s"),
            "nodes_stall_replicas_vs_none": rat("nodes_peer_stall_s", "nodes_plain_stall_s"),
            "nodes_durable_replicas_vs_none": rat("nodes_peer_durable_s", "nodes_plain_durable_s"),
            "nodes_promoted_replicas_vs_none": rat("nodes_peer_promoted_s", "nodes_plain_promoted_s"),
            "nodes_replicated_vs_promoted": rat("nodes_peer_replicated_s", "nodes_peer_promoted_s"),
        }
        return figs, rats

    def report(self, figs: dict[str, float | None], rats: dict[str, dict[str, Any]], pressure: float | None) -> None:
        gb = self.nbytes / 1e9

        def sec(key: str) -> str:
            v = figs.get(key)
            return f"{v:8.3f} s" if v is not None else "     n/a  "

        def thr(key: str) -> str:
            v = figs.get(key)
            return f"{gb / v:7.2f} GB/s" if v else ""

        def samples(key: str) -> str:
            return "[" + " ".join(f"{x:.3f}" for x in self.samples.get(key, [])) + "]"

        print(f"state: {self.nbytes / MiB:.0f} MiB in {len(self.kit.tensors())} tensors; endpoint {self.endpoint}; "
              f"best of {self.args.repeat} rounds after a first one; {os.cpu_count()} CPUs; torch {torch.__version__}")
        if pressure is not None:
            print(f"cpu pressure: some task waited for a CPU {pressure:.0%} of the run"
                  + ("  -> other work competed for the CPUs" if pressure > 0.2 else ""))
        print()
        print("ABSOLUTE (best of the rounds; seconds from save() start)       samples")
        rows = [
            ("single-tier local: save() stall", "single_stall_best_s"),
            ("single-tier local: durable (wait())", "single_durable_best_s"),
            ("tiered: save() stall", "tiered_stall_best_s"),
            ("tiered: time to durable, tier 1 (wait())", "tier1_durable_best_s"),
            ("tiered: tier 1 as time_to_durable says", "tier1_recorded_best_s"),
            ("tiered: time to promoted, tier 2 (S3)", "tier2_promoted_best_s"),
            ("tiered: promotion (tier 2 - tier 1 recorded)", "promotion_best_s"),
            ("boto3 upload_file, same files", "boto3_upload_best_s"),
            ("S3-only Checkpointer: save() stall", "s3single_stall_best_s"),
            ("S3-only Checkpointer: durable (wait())", "s3single_durable_best_s"),
            ("DCP* async_save: stall", "dcp_stall_best_s"),
            ("DCP* async_save: durable (result())", "dcp_durable_best_s"),
            ("tiered stall, promotion in flight", "inflight_stall_best_s"),
            ("single-tier stall beside it", "inflight_single_stall_best_s"),
            ("recovery: load_latest all from local", "recovery_local_best_s"),
            ("recovery: load_latest all from S3", "recovery_s3_best_s"),
            ("recovery: single-tier load_latest (local)", "recovery_single_best_s"),
            ("boto3 download_file, same S3 objects", "boto3_download_best_s"),
            ("2x2 replicas=0: save() stall (slowest rank)", "nodes_plain_stall_best_s"),
            ("2x2 replicas=0: durable (wait(), slowest)", "nodes_plain_durable_best_s"),
            ("2x2 replicas=0: time to promoted (S3)", "nodes_plain_promoted_best_s"),
            ("2x2 replicas=1: save() stall (slowest rank)", "nodes_peer_stall_best_s"),
            ("2x2 replicas=1: durable (wait(), slowest)", "nodes_peer_durable_best_s"),
            ("2x2 replicas=1: time to promoted (S3)", "nodes_peer_promoted_best_s"),
            ("2x2 replicas=1: time to replicated (peer)", "nodes_peer_replicated_best_s"),
            ("2x2 recovery: all-local (slowest rank)", "nodes_recovery_all_local_best_s"),
            ("2x2 recovery: one node from S3", "nodes_recovery_one_node_s3_best_s"),
            ("2x2 recovery: one node from peer", "nodes_recovery_one_node_peer_best_s"),
            ("2x2 recovery: all from S3", "nodes_recovery_all_s3_best_s"),
        ]
        for label, key in rows:
            print(f"  {label:<46}{sec(key)} {thr(key):>12}   {samples(key.replace('_best_s', '_s'))}")
        print()

        def fmt(v: float | None) -> str:
            return f"{v:7.2f}" if v is not None else "    n/a"

        def row(key: str, label: str, target: str = "") -> None:
            r = rats[key]
            each = " ".join(f"{x:.2f}" for x in r["paired"])
            print(f"  {label:<46}{fmt(r['best'])}{fmt(r['median'])}  {target:<16}[{each}]")

        print(f"  {'RATIOS (this run, same state)':<46}{'best/':>7}{'paired':>7}  {'target  result':<16}per-round")
        print(f"  {'':<46}{'best':>7}{'median':>7}")
        for key, label, op, bound in TARGETS:
            v = rats[key]["median"] if rats[key]["median"] is not None else rats[key]["best"]
            verdict = "n/a" if v is None else ("PASS" if (v <= bound if op == "<=" else v >= bound) else "MISS")
            row(key, label, f"{op} {bound:<4} {verdict}")
        for key, label in INFO:
            row(key, label)
        for key, label in NODE_ROWS:
            if rats[key]["best"] is None:
                print(f"  {label:<46}{self.nodes_na.get(key, 'n/a')}")
            else:
                row(key, label)
        print("verdicts on the paired median (best/best without pairs). Stall and time ratios: lower is better; throughput ratios: higher is better.")
        print("DCP* = async_save with one DefaultStager kept across saves, fsyncing (bench_save.py's reference).")
        print("Promotion and load check every checksum; boto3 checks none. Against moto both share one Python")
        print("server, whose ranged GETs cost time in proportion to the whole object (see the docstring).")
        print(f"before each timed section the run waited for background work to end ({self.quiet_waited:.0f} s in all)")
        for note in self.notes:
            print(note)
        print()
        print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in self.checks.items())
              + f"; verified: ckptctl verify {self.details.get('verify_promoted_url', '?')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=128, help="state size in MiB (default 128)")
    ap.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="counted rounds of each phase; figures are the best (default 3)")
    ap.add_argument("--stall-pairs", type=int, default=6,
                    help="extra single/tiered save pairs for the stall figures only (default 6)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures, ratios and checks here")
    ap.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"), help="use this store instead of moto")
    ap.add_argument("--bucket", default=None, help="existing bucket (default: a new one)")
    ap.add_argument("--dir", default=None, help="where the local tiers go (a temporary directory inside it)")
    ap.add_argument("--promote-timeout", type=float, default=600.0,
                    help="seconds to wait for one promotion (and for each 2x2 job)")
    ap.add_argument("--skip-nodes", action="store_true",
                    help="leave out the multi-node rows (2 torchrun nodes x 2 ranks, two launches)")
    args = ap.parse_args(argv)
    if args.size_mib < 1 or args.repeat < 1 or args.stall_pairs < 0:
        ap.error("--size-mib and --repeat must be at least 1, --stall-pairs at least 0")

    server = None
    endpoint = args.endpoint_url
    if not endpoint:
        server, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # ckptctl's S3 storage and the CLI find it here
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckptctl-bench-tiers-", dir=args.dir)
    try:
        import boto3

        bucket = args.bucket or f"ckptctl-bench-{uuid.uuid4().hex[:8]}"
        if not args.bucket:
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        s3_root = f"s3://{bucket}/bench-{uuid.uuid4().hex[:6]}"
        # Import time is nobody's stall.
        import ckptctl.checkpointer as _ck  # noqa: F401
        import torch.distributed.checkpoint as _dcp  # noqa: F401

        tb = TierBench(args, work, s3_root, endpoint, server.pid if server is not None else None)
        tb.progress(f"state {tb.nbytes / MiB:.0f} MiB; local tiers under {work}; S3 {s3_root}")
        p0, t0 = cpu_pressure_us(), time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
            tb.save_rounds()
        tb.verify_promoted()
        free_memory()
        tb.recovery_rounds()
        free_memory()
        tb.nodes_rounds()
        p1 = cpu_pressure_us()
        pressure = (p1 - p0) / 1e6 / (time.perf_counter() - t0) if p0 is not None and p1 is not None else None
        figs, rats = tb.figures()
        tb.report(figs, rats, pressure)
        ok = all(tb.checks.values())
        if args.json:
            doc = {
                "config": {"size_mib": args.size_mib, "bytes": tb.nbytes, "tensors": len(tb.kit.tensors()),
                           "repeat": args.repeat, "endpoint": endpoint, "cpus": os.cpu_count(),
                           "torch": torch.__version__},
                "figures": figs,
                "ratios": {k: v["best"] for k, v in rats.items()},
                "paired": {k: v["paired"] for k, v in rats.items()},
                "paired_median": {k: v["median"] for k, v in rats.items()},
                "targets": {k: {"op": op, "bound": bound} for k, _, op, bound in TARGETS},
                "not_measured": {k: v for k, v in tb.nodes_na.items() if rats[k]["best"] is None},
                "samples": tb.samples,
                "checks": tb.checks,
                "details": tb.details,
                "cpu_pressure": pressure,
                "ok": ok,
            }
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2)
        tb.progress("done" + ("" if ok else ": A CHECK FAILED"))
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
