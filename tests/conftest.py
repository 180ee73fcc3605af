"""Shared fixtures. Each group is self-contained; add yours in its own section."""

from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest

from moto_disk import drop_bucket

# --- c10d stores and this machine's resolver -------------------------------------------------
#
# c10d looks up the name of the peer of every new TCPStore connection (getnameinfo of
# ::ffff:127.0.0.1, which /etc/hosts does not list, so the query goes to the DNS server), on the
# connecting process and on the store's single server thread. This sandbox's resolver drops
# about one such query in 25 to 50, and glibc waits 5 s before asking again: a drop on the
# server thread stalls every store request of the job (heartbeats, barriers, the tiers'
# streams) for 5 s (the 5 s every two-node job's first save waited), and a resolver dropping
# them all would cost a two-node job (about 34 connections) minutes, silently. Here a dropped
# query costs 1 s and the second attempt answers; every process the tests start inherits it.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")

# --- S3: a real HTTP endpoint (moto in server mode) ----------------------------------------
#
# Code under test talks HTTP to a local moto server, configured the way users configure boto3
# (AWS_ENDPOINT_URL and credential variables), so the storage layer runs unmodified: no
# in-process mocking of botocore, and nothing of ours is replaced.

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Keep a developer's real ~/.aws out of the tests, and never probe EC2 instance metadata.
    "AWS_CONFIG_FILE": "/nonexistent/ckptctl-tests/config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/ckptctl-tests/credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_S3_ENV_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION",
                 "AWS_ENDPOINT_URL_S3", "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Start moto's S3 server on a free localhost port for the session; yield its URL.

    Dummy credentials are set for the whole session (moto accepts any).
    """
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for name, value in _S3_ENV.items():
            mp.setenv(name, value)
        for name in _S3_ENV_UNSET:
            mp.delenv(name, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_url(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh, empty bucket; yields ``s3://BUCKET/prefix``. ``AWS_ENDPOINT_URL`` points at
    the server, so code under test finds it through standard boto3 configuration."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    bucket = f"ckptctl-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/prefix"
    drop_bucket(bucket)  # moto would hold its bytes on disk until the session ends


@pytest.fixture
def atomic_s3_url(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Like ``s3_url``, on a moto server that handles one request at a time. S3 makes a
    conditional write atomic; moto checks, then writes, and two PUTs with ``If-None-Match: *``
    that meet between its check and its write would both succeed. Serialised, moto keeps the
    guarantee the code relies on, so a failed trial is ours, never moto's. As S3 does (and moto
    5.2 does not: it answers 500), a part or completion of an upload that was aborted meanwhile
    is refused with NoSuchUpload: racing writers of one object abort each other's uploads."""
    import threading
    from typing import Any, Callable, Iterable

    import boto3
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from moto.s3.exceptions import NoSuchUpload
    from moto.s3.models import S3Backend
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    for method in ("upload_part", "complete_multipart_upload"):
        def known_upload(self: Any, bucket_name: str, multipart_id: str, *args: Any,
                         _original: Callable[..., Any] = getattr(S3Backend, method), **kwargs: Any) -> Any:
            if multipart_id not in self.get_bucket(bucket_name).multiparts:
                raise NoSuchUpload(upload_id=multipart_id)
            return _original(self, bucket_name, multipart_id, *args, **kwargs)

        monkeypatch.setattr(S3Backend, method, known_upload)

    class Quiet(MotoRequestHandler):
        def log(self, *args: Any) -> None:  # a line per request would cost more than the request
            pass

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def one_at_a_time(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with lock:
            return list(app(environ, start_response))

    server = make_server("127.0.0.1", 0, one_at_a_time, threaded=True, request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    bucket = f"ckptctl-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    try:
        yield f"s3://{bucket}/prefix"
    finally:
        server.shutdown()
        thread.join(10)
        drop_bucket(bucket)


# --- S3 Express One Zone: a directory bucket, emulated in front of moto ----------------------


@pytest.fixture
def express_proxy(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator["FaultProxy"]:
    """The proxy in front of moto that answers for directory buckets as S3 Express One Zone
    does (``s3_directory_bucket``); ``AWS_ENDPOINT_URL`` points at it. Its ``rule`` injects
    faults as any ``FaultProxy``'s. A test that passed while a request was refused (an error
    swallowed on the way) fails at teardown."""
    from s3_directory_bucket import DirectoryBuckets
    from s3_fault_proxy import FaultProxy

    rules = DirectoryBuckets()
    proxy = FaultProxy(s3_server, emulation=rules).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        proxy.stop()
    assert not rules.refused, f"requests a directory bucket refuses: {rules.refused}"


@pytest.fixture
def express_url(s3_server: str, express_proxy: "FaultProxy") -> Iterator[str]:
    """Like ``s3_url``, on a directory bucket (``...--usw2-az1--x-s3``) behind ``express_proxy``,
    so a request AWS refuses there fails here too."""
    import boto3
    from botocore.config import Config

    bucket = f"ckptctl-test-{uuid.uuid4().hex[:12]}--usw2-az1--x-s3"
    # Created in moto directly: botocore would first ask the missing bucket for a session.
    direct = boto3.client("s3", endpoint_url=s3_server, config=Config(s3={"disable_s3_express_session_auth": True}))
    direct.create_bucket(Bucket=bucket)
    try:
        yield f"s3://{bucket}/prefix"
    finally:
        drop_bucket(bucket)
    assert express_proxy.emulation.sessions, "botocore never asked for a session: not treated as a directory bucket"
