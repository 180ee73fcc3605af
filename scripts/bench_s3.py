#!/usr/bin/env python
"""S3 throughput of ckptctl beside boto3's own transfer manager, on the same bytes, same run.

Starts moto's S3 server on 127.0.0.1 (or uses ``--endpoint-url`` / AWS_ENDPOINT_URL for a
real store), makes one checkpoint on local disk, then times:

  upload    ckptctl ``copy_checkpoint`` local -> s3 (every checksum checked on the way)
            vs boto3 ``upload_file`` (s3transfer) of the same shard files
  download  ckptctl ``restore_latest`` s3 -> local (every checksum checked on the way)
            vs boto3 ``download_file`` of the same objects
  save      ``Checkpointer.save`` straight to s3 (host copy, checksums, upload, commit; a
            Checkpointer that saved once, as in training) vs boto3 ``upload_file`` again

Both sides are checked afterwards, outside the timing: boto3's files byte for byte against the
source files, ckptctl's restored checkpoint by ``verify`` at the checksums level (the format's
own rule: a shard's file checksum covers its header bytes and chunk digests, not a hash of the
whole file). Only ckptctl's timing includes checking. Each comparison runs ``--repeat``
rounds alternating the two tools, each upload onto an emptied prefix; the verdict is the
median of the per-round ratios (the best of each side is printed beside it). Against moto
both sides share one Python server, so the ratios say more than the absolute numbers.

    .venv/bin/python scripts/bench_s3.py --size-mib 256 --files 2

moto on loopback answers a request in about 3 ms; a real store's round trip is 10-30 ms, and
what a tool spends in requests in series shows only then. ``--rtt-ms N`` holds every request
of both tools (they share botocore's sending path) for N ms before it is sent, a round trip's
latency without a bandwidth limit, so the ratios also say how the two tools' request patterns
fare against a distant store. ``--conn-mibps N`` also paces every connection's transfer to N
MiB/s each way (a real store serves one connection at 50-100 MB/s and scales by connections,
where moto on loopback serves one as fast as the CPU allows), so a tool that keeps fewer
requests in flight shows it.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from typing import Callable

import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import step_dir
from ckptctl.layouts.native_read import read_committed
from ckptctl.ops.transfer.copy import copy_checkpoint, restore_latest
from ckptctl.ops.verify.engine import verify_checkpoint
from ckptctl.storage import open_storage

MiB = 1 << 20


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's server in its own process: in this one it would share our GIL and skew both sides."""
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # moto spools every object and part over 5 MiB to a temporary file on this machine's disk,
    # so each upload also wrote (and the kernel flushed) its bytes twice there: rounds of the
    # same tool took 1.0 s or 2.1 s depending on writeback, whichever tool ran. A real store
    # writes nothing to the client's disk: keep objects in the server's memory (override with
    # MOTO_S3_DEFAULT_KEY_BUFFER_SIZE).
    env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": os.environ.get("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(4 << 30))}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto server did not start within 30 s")


# CPU seconds this process (every thread) spent in each timed section, by label: on a machine
# whose cores the server, the client and other work share, the client's CPU per byte decides
# as much as its concurrency, and it does not swing with the load as wall time does.
CPU: dict[str, list[float]] = {}


def timed(fn: Callable[[], object], before: Callable[[], None] | None = None, *, cpu: str = "") -> float:
    if before:
        before()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    if cpu:
        CPU.setdefault(cpu, []).append(time.process_time() - c0)
    return seconds


def pairs(repeat: int, a: Callable[[], float], b: Callable[[], float]) -> tuple[list[float], list[float]]:
    """``repeat`` timings of each, alternating a and b so that drift in the server (moto keeps
    every object in memory) and in the machine's load weighs on both alike. Which goes first
    alternates too (a b, b a, a b, ...): the first transfer after moto starts, or after the
    other tool's, pays for what the server left behind (its first requests, freeing the last
    round's objects), and that should not always be the same tool's."""
    ta, tb = [], []
    for r in range(repeat):
        if r % 2:
            tb.append(b())
            ta.append(a())
        else:
            ta.append(a())
            tb.append(b())
    return ta, tb


def ratio_line(what: str, ours: list[float], theirs: list[float], label_ours: str, label_theirs: str, total: int) -> str:
    """Best of each side, their ratio, and the median of the per-pair ratios (the figure that
    a single slow round of either side moves least)."""
    pair = statistics.median(t / o for o, t in zip(ours, theirs))
    each = " ".join(f"{t / o:.2f}" for o, t in zip(ours, theirs))
    return (f"{what:9} {label_ours:18} {rate(total, min(ours))}   {label_theirs:20} {rate(total, min(theirs))}   "
            f"best/best {min(theirs) / min(ours):.2f}x   pairs median {pair:.2f}x [{each}]")


def rate(total: int, seconds: float) -> str:
    return f"{total / MiB / seconds:8.1f} MiB/s ({seconds:6.2f} s)"


def cpu_of(label: str) -> float:
    """The least CPU time of ``label``'s runs (as the best wall time is the least)."""
    return min(CPU[label])


def emulate_round_trip(rtt_s: float) -> None:
    """Every request botocore sends in this process, whichever tool made it, waits ``rtt_s``
    first: a benchmark-only hook on its sending path (``Endpoint._send``)."""
    import botocore.endpoint

    send = botocore.endpoint.Endpoint._send

    def delayed(self, request):  # type: ignore[no-untyped-def]
        time.sleep(rtt_s)
        return send(self, request)

    botocore.endpoint.Endpoint._send = delayed


def pace_connections(mib_s: float) -> None:
    """Every response body read and every request body sent in this process, whichever tool,
    goes no faster than ``mib_s`` per connection: a benchmark-only pacing of urllib3's reads
    and http.client's sends (both tools' bytes pass through them)."""
    import http.client

    import urllib3.response

    rate = mib_s * MiB
    # When each connection (or response) may move its next byte: no credit builds up while idle.
    free_at: "weakref.WeakKeyDictionary[object, float]" = weakref.WeakKeyDictionary()

    def pace(owner: object, n: int) -> None:
        now = time.perf_counter()
        free_at[owner] = max(now, free_at.get(owner, now)) + n / rate
        if free_at[owner] > now:
            time.sleep(free_at[owner] - now)

    read = urllib3.response.HTTPResponse.read

    def paced_read(self, amt=None, *args, **kwargs):  # type: ignore[no-untyped-def]
        data = read(self, amt, *args, **kwargs)
        pace(self, len(data))
        return data

    send = http.client.HTTPConnection.send

    def paced_send(self, data):  # type: ignore[no-untyped-def]
        if hasattr(data, "read"):  # a file-like body (botocore's checksum-trailer wrapper): in blocks
            while block := data.read(1 << 20):
                paced_send(self, block)
            return
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            for at in range(0, len(view), 1 << 20):
                send(self, view[at : at + (1 << 20)])
                pace(self, len(view[at : at + (1 << 20)]))
            return
        send(self, data)

    urllib3.response.HTTPResponse.read = paced_read
    http.client.HTTPConnection.send = paced_send


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256, help="checkpoint size (default 256)")
    ap.add_argument("--files", type=int, default=1, help="shard files it is split into, as ranks would (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds per comparison (default 3)")
    ap.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"), help="use this store instead of moto")
    ap.add_argument("--bucket", default=None, help="existing bucket (default: a new one)")
    ap.add_argument("--part-mib", type=int, default=None, help="ckptctl's multipart threshold and part size (default: S3Storage's)")
    ap.add_argument("--inflight", type=int, default=None, help="ckptctl's parts in flight per file (default: S3Storage's)")
    ap.add_argument("--read-concurrency", type=int, default=None, help="ckptctl's GETs in flight per file read (default: S3Storage's)")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="hold every request of both tools this long (default 0)")
    ap.add_argument("--conn-mibps", type=float, default=0.0, help="pace each connection of both tools to this rate (default: none)")
    args = ap.parse_args()
    if args.rtt_ms:
        emulate_round_trip(args.rtt_ms / 1000)
    if args.conn_mibps:
        pace_connections(args.conn_mibps)

    server = None
    endpoint = args.endpoint_url
    if not endpoint:
        server, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    import boto3
    from boto3.s3.transfer import TransferConfig

    s3 = boto3.client("s3", endpoint_url=endpoint)
    bucket = args.bucket or f"ckptctl-bench-{uuid.uuid4().hex[:8]}"
    if not args.bucket:
        s3.create_bucket(Bucket=bucket)
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    url = f"s3://{bucket}/{prefix}"
    work = tempfile.mkdtemp(prefix="ckptctl-bench-s3-")
    try:
        # One checkpoint on local disk; with --files N, re-sharded into N files as N ranks
        # would have written it.
        state = {"model": {"w": torch.randn(args.size_mib * MiB // 4)}}
        one = os.path.join(work, "one")
        with Checkpointer(one) as ck:
            ck.save(1, state).wait()
        local = os.path.join(work, "local")
        src = os.path.join(local, step_dir(1))
        if args.files > 1:
            from ckptctl.ops.transform.reshard import reshard

            reshard(open_storage(os.path.join(one, step_dir(1))), open_storage(src), args.files)
        else:
            os.rename(one, local)
        manifest, _ = read_committed(open_storage(src))
        total = manifest.total_bytes
        names = [f.name for f in manifest.files]
        print(f"endpoint {endpoint}; checkpoint {total / MiB:.0f} MiB in {len(names)} file(s); {args.repeat} alternating rounds"
              + (f"; every request held {args.rtt_ms:g} ms (--rtt-ms)" if args.rtt_ms else "")
              + (f"; each connection paced to {args.conn_mibps:g} MiB/s (--conn-mibps)" if args.conn_mibps else ""))

        cfg = TransferConfig()  # boto3's defaults: 8 MiB threshold and chunks, 10 threads
        tuning: dict[str, int] = {}
        if args.part_mib:
            tuning.update(multipart_threshold=args.part_mib * MiB, part_size=args.part_mib * MiB)
        if args.inflight:
            tuning.update(max_inflight_parts=args.inflight)
        if args.read_concurrency:
            tuning.update(read_concurrency=args.read_concurrency)
        store = open_storage(url, **tuning)

        def clearer(where: str) -> Callable[[], None]:
            """Empty ``where`` before a timed upload (untimed), for both tools alike: moto
            replaces an existing object about 2x slower than it creates one (a probe: 2.2-2.4 s
            against 1.1-1.2 s for 256 MiB), so an upload onto last round's object is not a fair
            round."""
            def clear() -> None:
                sub = store.sub(where)
                for info in list(sub.list()):
                    sub.delete(info.key)
            return clear

        up_ckptctl, up_boto = pairs(
            args.repeat,
            lambda: timed(lambda: copy_checkpoint(open_storage(src), store.sub("ckptctl-up").sub(step_dir(1))),
                          clearer("ckptctl-up"), cpu="up ckptctl"),
            lambda: timed(lambda: [s3.upload_file(os.path.join(src, n), bucket, f"{prefix}/boto/{n}", Config=cfg) for n in names],
                          clearer("boto"), cpu="up boto3"),
        )

        dst = os.path.join(work, "restored")
        boto_dst = os.path.join(work, "boto")
        os.makedirs(boto_dst)
        down_ckptctl, down_boto = pairs(
            args.repeat,
            lambda: timed(lambda: restore_latest(store.sub("ckptctl-up"), open_storage(dst)),
                          lambda: shutil.rmtree(dst, ignore_errors=True), cpu="down ckptctl"),
            lambda: timed(lambda: [s3.download_file(bucket, f"{prefix}/boto/{n}", os.path.join(boto_dst, n), Config=cfg) for n in names],
                          cpu="down boto3"),
        )
        # Both moved the right bytes (checked outside the timing).
        for n in names:
            if not filecmp.cmp(os.path.join(src, n), os.path.join(boto_dst, n), shallow=False):
                raise SystemExit(f"boto3's download of {n} differs from the source file")
        report = verify_checkpoint(open_storage(os.path.join(dst, step_dir(1))), "checksums")
        if not report.ok:
            raise SystemExit(f"ckptctl's restored checkpoint does not verify: {report.to_dict()}")

        steps = iter(range(100, 101 + args.repeat))
        with Checkpointer(url + "/saves", storage=store.sub("saves")) as ck:
            ck.save(next(steps), state).wait()  # its staging buffer mapped: later saves copy into it
            save_s3, up_boto2 = pairs(
                args.repeat,
                lambda: timed(lambda: ck.save(next(steps), state).wait(), cpu="save ckptctl"),
                lambda: timed(lambda: [s3.upload_file(os.path.join(src, n), bucket, f"{prefix}/boto2/{n}", Config=cfg)
                                       for n in names], clearer("boto2"), cpu="save boto3"),
            )

        print(ratio_line("upload", up_ckptctl, up_boto, "ckptctl cp", "boto3 upload_file", total))
        print(ratio_line("download", down_ckptctl, down_boto, "ckptctl restore", "boto3 download_file", total))
        print(ratio_line("save", save_s3, up_boto2, "Checkpointer.save", "boto3 upload_file", total)
              + "  (save: host copy + checksums + upload + commit)")
        print("ratio > 1: ckptctl faster; ckptctl's times include checking every checksum, boto3's include none;")
        print("the verdict is the pairs' median (rounds alternate the tools; each starts on an empty prefix)")
        print("client CPU (this process, all threads; least of the runs), boto3 / ckptctl > 1: ckptctl uses less")
        for what in ("up", "down", "save"):
            ours, theirs = cpu_of(f"{what} ckptctl"), cpu_of(f"{what} boto3")
            print(f"  {what:8}  ckptctl {ours:6.2f} s   boto3 {theirs:6.2f} s   ratio {theirs / ours:.2f}x")
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
