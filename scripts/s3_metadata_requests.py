#!/usr/bin/env python
"""The requests ``restore``, ``latest`` and ``verify --latest`` send on S3 before their first
data GET (a ranged GET of a shard's chunks), each with the frames of ckptctl that sent it.

Starts moto's S3 server in-process on 127.0.0.1, saves one checkpoint with ``Checkpointer``
straight to ``s3://BUCKET/root``, then runs each verb in-process (the CLI, as a user would) and
logs every request botocore sends, in order. On a real store each is a round trip of 15-50 ms,
and these are sent one after another: the count is what a restore waits before its data.

    .venv/bin/python scripts/s3_metadata_requests.py [--stacks] [--verb restore] [--steps 3] [--rtt-ms 15]

``--stacks`` prints the ckptctl frames that sent each request (innermost last). ``--rtt-ms N``
holds every request N ms before it is sent (``bench_s3.emulate_round_trip``), and each verb's
line then says how long after it began its first data GET was sent (median of ``--repeat``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import traceback
import uuid

MiB = 1 << 20


def start_moto() -> str:
    from moto.server import ThreadedMotoServer

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():
        os.environ[name] = value
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    os.environ["AWS_ENDPOINT_URL"] = url
    return url


def is_data_get(op: str, params: dict) -> bool:
    """A GET of a shard's chunks (1 MiB or more; the header's reads are far smaller): what the
    verb is there for."""
    if op != "GetObject" or not params.get("Key", "").endswith(".safetensors"):
        return False
    first, _, last = str(params.get("Range", "bytes=0-")).removeprefix("bytes=").partition("-")
    return not last or int(last) - int(first) + 1 >= MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stacks", action="store_true", help="print the ckptctl frames of each request")
    ap.add_argument("--verb", action="append", choices=["restore", "latest", "verify"], help="default: all three")
    ap.add_argument("--steps", type=int, default=1, help="checkpoints saved (default 1)")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="hold every request this long (default 0)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each verb timed with --rtt-ms (default 5)")
    args = ap.parse_args()
    endpoint = start_moto()

    import boto3
    import torch
    from typer.testing import CliRunner

    from ckptctl import Checkpointer
    from ckptctl.cli.app import app
    from ckptctl.storage import open_storage

    bucket = f"meta-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    root = f"s3://{bucket}/root"
    with Checkpointer(root) as ck:
        for step in range(1, args.steps + 1):
            ck.save(step, {"w": torch.arange(8 * MiB // 4, dtype=torch.float32) + step}).wait()

    client = open_storage(root)._client.s3  # type: ignore[attr-defined]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log: list[tuple[str, dict, list[str], float]] = []
    lock = threading.Lock()

    def sent(event_name: str, params: dict, **_kw: object) -> None:
        frames = [f"{os.path.relpath(f.filename, here)}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                  if f.filename.startswith(os.path.join(here, "ckptctl"))]
        with lock:
            log.append((event_name.rsplit(".", 1)[-1], dict(params), frames, time.perf_counter()))

    if args.rtt_ms:
        from bench_s3 import emulate_round_trip

        emulate_round_trip(args.rtt_ms / 1000)

    client.meta.events.register("provide-client-params.s3", sent)
    verbs = {"restore": lambda dest: ["restore", root, dest],
             "latest": lambda dest: ["latest", root],
             "verify": lambda dest: ["verify", root, "--latest"]}
    for verb in args.verb or list(verbs):
        waited: list[float] = []
        for _round in range(args.repeat if args.rtt_ms else 1):
            with tempfile.TemporaryDirectory() as tmp:
                log.clear()
                t0 = time.perf_counter()
                r = CliRunner().invoke(app, verbs[verb](os.path.join(tmp, "dest")), catch_exceptions=False)
                assert r.exit_code == 0, (verb, r.exit_code, r.output)
                with lock:
                    seen = list(log)
            first = next((i for i, (op, params, _, _) in enumerate(seen) if is_data_get(op, params)), len(seen))
            if first < len(seen):
                waited.append(seen[first][3] - t0)
        when = f", sent {statistics.median(waited) * 1000:.0f} ms after the verb began (median of {len(waited)}, " \
               f"{args.rtt_ms:g} ms a request)" if args.rtt_ms and waited else ""
        print(f"{verb}: {first} requests before its first data GET ({len(seen)} in all){when}")
        for op, params, frames, _ in seen[:first]:
            key = params.get("Key") or params.get("Prefix", "")
            extra = f" Range={params['Range']}" if "Range" in params else ""
            print(f"  {op:<14} {key}{extra}")
            if args.stacks:
                for frame in frames[-6:]:
                    print(f"      {frame}")


if __name__ == "__main__":
    main()
