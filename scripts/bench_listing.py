#!/usr/bin/env python
"""Root-wide verbs on S3 (``ls``, ``du``, ``prune --dry-run``) with their checkpoints looked at
several at once (``layouts.lookups``), and ``prune`` deleting checkpoints of many shard files
with the files after the commit files deleted several at once (``layouts.removal``), beside
the same verbs one request at a time (``settings.REQUEST_THREADS`` = 1), in the same run,
against moto on 127.0.0.1 with every request held ``--rtt-ms`` (a real store's round trip;
``bench_s3.emulate_round_trip``).

Each checkpoint costs a listing verb a few small requests (its marker, its manifest, listings
of its files), each deleted file a stat and a delete: what decides the verb's time on a real
store is how many round trips it waits for in series, which the ratio shows; the request
count is printed beside it.

    .venv/bin/python scripts/bench_listing.py [--checkpoints 100] [--shards 64] [--rtt-ms 15] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=100, help="checkpoints under the root (default 100)")
    ap.add_argument("--shards", type=int, default=64, help="shard files of each checkpoint prune deletes (default 64)")
    ap.add_argument("--rtt-ms", type=float, default=15.0, help="each request held this long (default 15)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per verb and mode, alternating (default 3)")
    args = ap.parse_args()

    import s3_metadata_requests as requests_probe

    requests_probe.start_moto()
    import boto3
    import torch

    import ckptctl.layouts.lookups as lookups
    import ckptctl.layouts.removal as removal
    from ckptctl import Checkpointer
    from ckptctl.format.layout import step_dir
    from ckptctl.storage.s3_client import shared_client
    from helpers import cli

    import tempfile

    boto3.client("s3").create_bucket(Bucket="ckptctl-bench-listing")
    root = "s3://ckptctl-bench-listing/root"
    with Checkpointer(root) as ck:
        for step in range(1, args.checkpoints + 1):
            ck.save(step, {"w": torch.randn(1000)}).wait()
    # Two checkpoints of --shards files each, on local disk: each prune round copies them to
    # S3 (untimed) and deletes the older.
    local = tempfile.mkdtemp(prefix="ckptctl-bench-listing-")
    with Checkpointer(f"{local}/one") as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.randn(args.shards * 4, 64)}).wait()
    for step in (1, 2):
        r = cli("reshard", f"{local}/one/{step_dir(step)}", f"{local}/many/{step_dir(step)}", "--world-size", str(args.shards))
        if r.exit_code != 0:
            raise SystemExit(f"reshard: {r.stderr}")
    rtt = [args.rtt_ms / 1000]  # 0 while setting up a round: the copies are not timed
    import botocore.endpoint

    send = botocore.endpoint.Endpoint._send

    def held(self, request):  # type: ignore[no-untyped-def]
        time.sleep(rtt[0])
        return send(self, request)

    botocore.endpoint.Endpoint._send = held
    sent = [0]
    shared_client(None).s3.meta.events.register("provide-client-params.s3", lambda **_kw: sent.__setitem__(0, sent[0] + 1))
    threads = lookups.REQUEST_THREADS
    print(f"{args.checkpoints} checkpoints on moto, {args.rtt_ms:g} ms per request; REQUEST_THREADS={threads}")
    deleting = f"{root}-deleting"
    for verb in (["ls"], ["du"], ["prune", "--keep-last", "3", "--dry-run"], ["prune", "--keep-last", "1", "--yes"]):
        where = deleting if "--yes" in verb else root
        what = " ".join(verb) + (f" ({args.shards} shards)" if "--yes" in verb else "")
        times: dict[int, list[float]] = {1: [], threads: []}
        count = 0
        for _ in range(args.repeat):
            for n in (threads, 1):
                if "--yes" in verb:
                    rtt[0] = 0.0  # the copies are set-up, not timed
                    for step in (1, 2):
                        cli("cp", f"{local}/many/{step_dir(step)}", f"{deleting}/{step_dir(step)}")
                    rtt[0] = args.rtt_ms / 1000
                lookups.REQUEST_THREADS = removal.REQUEST_THREADS = n
                sent[0] = 0
                t0 = time.perf_counter()
                r = cli(verb[0], where, *verb[1:])
                times[n].append(time.perf_counter() - t0)
                if r.exit_code != 0:
                    raise SystemExit(f"ckptctl {' '.join(verb)}: exit {r.exit_code}: {r.stderr}")
                count = sent[0]
        one, many = statistics.median(times[1]), statistics.median(times[threads])
        print(f"{what:40} one at a time {one:6.2f} s   {threads} at a time {many:6.2f} s   "
              f"speed-up {one / many:5.1f}x   {count} requests")
    lookups.REQUEST_THREADS = removal.REQUEST_THREADS = threads
    import shutil

    shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()
