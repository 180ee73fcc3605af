"""Requests a verb makes on S3 (moto over HTTP), counted through botocore's event hooks: a
layout's check opens each file of another tool's checkpoint once, whatever it checks in it
(each open is a HEAD, and object storage bills and waits per request)."""

from __future__ import annotations

import os
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import boto3

from ckptctl.errors import StorageError
from ckptctl.storage import open_storage
from ckptctl.storage.base import Reader
from ckptctl.storage.local import LocalStorage
from helpers import cli
from test_layouts import hf_checkpoint


@contextmanager
def counting(client: Any) -> Iterator[Counter[str]]:
    """The requests ``client`` makes inside the block, by operation name."""
    counts: Counter[str] = Counter()

    def count(event_name: str, **_kw: object) -> None:
        counts[event_name.rsplit(".", 1)[-1]] += 1

    client.meta.events.register("before-call.s3", count)
    try:
        yield counts
    finally:
        client.meta.events.unregister("before-call.s3", count)


@contextmanager
def request_log(client: Any) -> Iterator[list[tuple[str, str, str]]]:
    """Each request ``client`` makes inside the block, in order, when it is sent and when it is
    answered: ``("sent" | "answered", operation, key)``."""
    log: list[tuple[str, str, str]] = []
    lock = threading.Lock()

    def sent(event_name: str, params: dict, context: dict, **_kw: object) -> None:
        context["ckptctl-test-key"] = params.get("Key", "")
        with lock:
            log.append(("sent", event_name.rsplit(".", 1)[-1], params.get("Key", "")))

    def answered(event_name: str, context: dict, **_kw: object) -> None:
        with lock:
            log.append(("answered", event_name.rsplit(".", 1)[-1], context.get("ckptctl-test-key", "")))

    client.meta.events.register("provide-client-params.s3", sent)
    client.meta.events.register("after-call.s3", answered)
    try:
        yield log
    finally:
        client.meta.events.unregister("provide-client-params.s3", sent)
        client.meta.events.unregister("after-call.s3", answered)


def test_verify_of_a_trainer_checkpoint_on_s3_opens_each_file_once(tmp_path, s3_url):
    ckpt = hf_checkpoint(str(tmp_path), 5)
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    raw = boto3.client("s3")
    names = sorted(os.listdir(ckpt))
    for name in names:
        raw.upload_file(os.path.join(ckpt, name), bucket, f"{prefix}/checkpoint-5/{name}")
    client = open_storage(s3_url)._client.s3  # the process's shared client: every verb uses it
    with counting(client) as counts:
        r = cli("verify", f"{s3_url}/checkpoint-5")
    assert r.exit_code == 0, r.stderr
    # One HEAD per file for the checks, plus the commit rule's look at trainer_state.json and the
    # classifier's: before the files were opened once, a torch file alone took four.
    assert len(names) <= counts.get("HeadObject", 0) <= len(names) + 4, (counts, names)


def test_cp_to_s3_lists_unfinished_uploads_once_not_per_file(tmp_path, s3_url):
    # The copy aborts the open uploads of the keys it is about to write (one listing of the
    # directory); each file's writer then listed the same key's uploads again before its first
    # part: a request per file on the path of every cp, restore and tier promotion.
    import torch

    from ckptctl import Checkpointer
    from ckptctl.format.layout import step_dir
    from ckptctl.ops.transfer.copy import copy_checkpoint
    from ckptctl.ops.transform.reshard import reshard

    with Checkpointer(str(tmp_path / "one")) as ck:
        ck.save(1, {"w": torch.arange(3 << 20, dtype=torch.float32)}).wait()  # 12 MiB
    src = str(tmp_path / "three" / step_dir(1))
    reshard(open_storage(str(tmp_path / "one" / step_dir(1))), open_storage(src), 3)
    # Parts of 5 MiB: every 4 MiB file is past a 1 MiB threshold, so each is a multipart upload.
    dst = open_storage(s3_url, multipart_threshold=1 << 20, part_size=5 << 20)
    with counting(dst._client.s3) as counts:  # type: ignore[attr-defined]
        copy_checkpoint(open_storage(src), dst.sub(step_dir(1)))
    assert counts.get("CreateMultipartUpload") == 3, counts
    assert counts.get("ListMultipartUploads") == 1, counts  # on main: 4 (the copy's, then one per file)


class _ReadWaitsForUpload(LocalStorage):
    """A source whose file reads past the header wait until the destination's multipart upload
    was created: a copy that creates it only once a part's worth was read never gets there."""

    def __init__(self, path: str, created: threading.Event) -> None:
        super().__init__(path)
        self.created = created

    def open_reader(self, key: str) -> Reader:
        reader = super().open_reader(key)
        if not key.endswith(".safetensors"):
            return reader
        inner, created = reader.read_into, self.created

        def read_into(offset: int, out: memoryview) -> None:
            if len(out) >= 1 << 20 and not created.wait(30):  # not the header check's small read
                raise StorageError(f"{key}: read before the multipart upload was created", hint="")
            inner(offset, out)

        reader.read_into = read_into  # type: ignore[method-assign]
        return reader


def test_cp_to_s3_creates_the_upload_before_reading_the_file(tmp_path, s3_url):
    # The copy knows each file's size, so the writer creates the multipart upload while the first
    # part's bytes are read and checked; on main it was created only once more than a part's
    # worth had been read, a request's wait before the first part of every cp and promotion.
    import torch

    from ckptctl import Checkpointer
    from ckptctl.format.layout import step_dir
    from ckptctl.ops.transfer.copy import copy_checkpoint

    with Checkpointer(str(tmp_path / "one")) as ck:
        ck.save(1, {"w": torch.arange(3 << 20, dtype=torch.float32)}).wait()  # 12 MiB
    dst = open_storage(s3_url, multipart_threshold=5 << 20, part_size=5 << 20)
    created = threading.Event()
    client = dst._client.s3  # type: ignore[attr-defined]

    def seen(**_kw: object) -> None:
        created.set()

    client.meta.events.register("before-call.s3.CreateMultipartUpload", seen)
    try:
        copy_checkpoint(_ReadWaitsForUpload(str(tmp_path / "one" / step_dir(1)), created), dst.sub(step_dir(1)))
    finally:
        client.meta.events.unregister("before-call.s3.CreateMultipartUpload", seen)
    r = cli("verify", dst.url_of(step_dir(1)))
    assert r.exit_code == 0, r.stdout + r.stderr


def test_cp_to_s3_lists_uploads_and_objects_of_the_destination_at_once(tmp_path, s3_url):
    # Before the first part, a copy aborts a killed earlier run's uploads (ListMultipartUploads)
    # and looks for files already there (ListObjectsV2): independent, so both are in flight at
    # once. On main the second waited for the first; here the first waits for the second to be
    # sent, which only a copy asking both at once gets past.
    import torch

    from ckptctl import Checkpointer
    from ckptctl.format.layout import step_dir
    from ckptctl.ops.transfer.copy import copy_checkpoint

    with Checkpointer(str(tmp_path / "one")) as ck:
        ck.save(1, {"w": torch.arange(1 << 20, dtype=torch.float32)}).wait()
    dst = open_storage(s3_url)
    listing = threading.Event()
    client = dst._client.s3  # type: ignore[attr-defined]

    def objects(params: dict, **_kw: object) -> None:
        if params.get("Prefix", "").endswith(step_dir(1) + "/"):  # the directory's listing, not a stat's
            listing.set()

    def uploads(**_kw: object) -> None:
        if not listing.wait(30):
            raise AssertionError("ListMultipartUploads went out alone: the destination's listing waited for it")

    client.meta.events.register("provide-client-params.s3.ListObjectsV2", objects)
    client.meta.events.register("before-call.s3.ListMultipartUploads", uploads)
    try:
        copy_checkpoint(open_storage(str(tmp_path / "one" / step_dir(1))), dst.sub(step_dir(1)))
    finally:
        client.meta.events.unregister("provide-client-params.s3.ListObjectsV2", objects)
        client.meta.events.unregister("before-call.s3.ListMultipartUploads", uploads)
    assert cli("verify", dst.url_of(step_dir(1))).exit_code == 0


def test_stat_is_one_request_for_a_file_a_directory_and_a_miss(s3_url):
    # Every commit asks whether the marker is there (a miss, the common case) and every copy
    # asks first; a HEAD answered a miss only with a second request (a LIST: is it a
    # "directory"?), two round trips in series on the path of each save and copy.
    st = open_storage(s3_url)
    st.write_atomic("step/COMMITTED", b"x")
    with counting(st._client.s3) as counts:  # type: ignore[attr-defined]
        answers = [st.stat(key) for key in ("step/COMMITTED", "step", "step/manifest.json")]
    assert [a.kind if a else None for a in answers] == ["file", "dir", None]
    assert sum(counts.values()) == 3, counts  # on main: 5 (HEAD + LIST for each of the two not files)


def test_stat_and_children_on_a_directory_bucket_ask_what_it_accepts(express_url):
    # A directory bucket refuses the one-LIST stat (its prefix, the key itself, does not end in
    # "/"): a HEAD answers for a file; a directory or a miss takes a LIST of one key more. A
    # listing with directories asks once for the unfinished uploads below it (a directory only
    # an upload holds is no directory); a listing of files alone asks nothing more.
    st = open_storage(express_url)
    st.write_atomic("step/COMMITTED", b"x")
    with counting(st._client.s3) as counts:  # type: ignore[attr-defined]
        answers = [st.stat(key) for key in ("step/COMMITTED", "step", "step/manifest.json")]
    assert [a.kind if a else None for a in answers] == ["file", "dir", None]
    assert counts == Counter({"HeadObject": 3, "ListObjectsV2": 2}), counts
    with counting(st._client.s3) as counts:  # type: ignore[attr-defined]
        assert [i.key for i in st.children()] == ["step"] and [i.key for i in st.children("step")] == ["step/COMMITTED"]
    assert counts == Counter({"ListObjectsV2": 2, "ListMultipartUploads": 1}), counts


def _one_step(root: str, step: int = 1, elements: int = 1 << 20) -> str:
    import torch

    from ckptctl import Checkpointer
    from ckptctl.format.layout import step_dir

    with Checkpointer(root) as ck:
        ck.save(step, {"w": torch.arange(elements, dtype=torch.float32)}).wait()
    return os.path.join(root, step_dir(step))


def test_cp_to_s3_asks_for_the_verdict_beside_the_uploads_and_the_listing(tmp_path, s3_url):
    # Before its first part a copy asks whether a checkpoint is committed at the destination
    # (the marker), aborts the open uploads of its keys and lists the names taken: on main the
    # marker's answer came first and the other two waited for it. Here the marker's look waits
    # until the uploads' listing was sent, which only a copy asking them at once gets past.
    from ckptctl.format.layout import step_dir
    from ckptctl.ops.transfer.copy import copy_checkpoint

    src = _one_step(str(tmp_path / "src"))
    dst = open_storage(s3_url)
    uploads = threading.Event()
    client = dst._client.s3  # type: ignore[attr-defined]

    def sent(**_kw: object) -> None:
        uploads.set()

    def marker(params: dict, **_kw: object) -> None:
        if params.get("Prefix", "").endswith("/COMMITTED") and not uploads.wait(10):
            raise AssertionError("the marker's look went out alone: the uploads' listing waited for its answer")

    client.meta.events.register("before-call.s3.ListMultipartUploads", sent)
    client.meta.events.register("provide-client-params.s3.ListObjectsV2", marker)
    try:
        copy_checkpoint(open_storage(src), dst.sub(step_dir(1)))
    finally:
        client.meta.events.unregister("before-call.s3.ListMultipartUploads", sent)
        client.meta.events.unregister("provide-client-params.s3.ListObjectsV2", marker)
    assert cli("verify", dst.url_of(step_dir(1))).exit_code == 0


def test_a_save_to_s3_looks_for_the_marker_once(tmp_path, s3_url):
    # save() looks for the step's marker beside the snapshot; the commit decides by its
    # conditional writes. On main the commit looked again after the last shard: a round trip
    # on every save to object storage, between the data and the marker.
    import torch

    from ckptctl import Checkpointer

    with Checkpointer(s3_url) as ck:
        ck.save(1, {"w": torch.zeros(4)}).wait()  # the root's first save: whatever it sets up
        client = ck.root._client.s3  # type: ignore[attr-defined]
        with counting(client) as counts:
            ck.save(2, {"w": torch.ones(4)}).wait()
    assert counts["ListObjectsV2"] + counts["HeadObject"] == 1, counts  # on main: 2
    assert counts["PutObject"] == 3, counts  # the shard, the manifest, the marker


def test_a_copy_finding_another_manifest_there_is_refused_before_sending_data(tmp_path, s3_url):
    # A copy writes its manifest before its data. Another checkpoint committed at the step just
    # before that write (after the copy's look at the marker): the copy is refused then,
    # having sent no byte of its shard (on main it uploaded the shard, then lost at its commit),
    # and the winner reads as before.
    from ckptctl.errors import RefusedForSafety
    from ckptctl.format.layout import MARKER, step_dir
    from ckptctl.ops.transfer.copy import copy_checkpoint

    ours = _one_step(str(tmp_path / "ours"), elements=1 << 10)
    theirs = _one_step(str(tmp_path / "theirs"), elements=1 << 11)
    dst = open_storage(s3_url).sub(step_dir(1))
    client = dst._client.s3  # type: ignore[attr-defined]
    fired: list[str] = []
    shard: list[str] = []

    def winner(params: dict, **_kw: object) -> None:  # just before our manifest goes out
        if params.get("Key", "").endswith(".safetensors"):
            shard.append(params["Key"])
        if params.get("Key", "").endswith("/manifest.json") and not fired:
            fired.append(params["Key"])
            for name in sorted(os.listdir(theirs), key=lambda n: n == MARKER):  # the marker last
                with open(os.path.join(theirs, name), "rb") as f:
                    boto3.client("s3").put_object(Bucket=params["Bucket"], Key=params["Key"].rsplit("/", 1)[0] + "/" + name,
                                                  Body=f.read())

    for op in ("PutObject", "CreateMultipartUpload"):
        client.meta.events.register(f"provide-client-params.s3.{op}", winner)
    try:
        try:
            copy_checkpoint(open_storage(ours), dst)
            raise AssertionError("the copy committed over another checkpoint")
        except RefusedForSafety as e:  # whichever answer came first: the marker's look or the manifest's write
            assert "another checkpoint's manifest" in str(e) or "different committed checkpoint" in str(e), e
    finally:
        for op in ("PutObject", "CreateMultipartUpload"):
            client.meta.events.unregister(f"provide-client-params.s3.{op}", winner)
    assert fired
    assert shard == [], shard  # on main: the shard was uploaded first
    assert sorted(i.key for i in dst.list()) == sorted(os.listdir(theirs))
    assert cli("verify", dst.url).exit_code == 0


def test_a_copy_that_loses_the_step_at_its_marker_deletes_what_it_wrote(tmp_path, s3_url):
    # A save of the step commits just before the copy's marker: the copy's manifest (written
    # before its data) and shard took the plain names, so the save published under its attempt
    # names and won with its marker. The copy deletes exactly what it wrote, its early manifest
    # too, and the winner verifies.
    import torch

    from ckptctl import Checkpointer
    from ckptctl.errors import RefusedForSafety
    from ckptctl.format.layout import MANIFEST, MARKER, step_dir
    from ckptctl.layouts.native_read import read_committed_raw
    from ckptctl.ops.transfer.copy import copy_checkpoint

    ours = _one_step(str(tmp_path / "ours"), elements=1 << 10)
    dst = open_storage(s3_url).sub(step_dir(1))
    client = dst._client.s3  # type: ignore[attr-defined]
    fired: list[str] = []

    def winner(params: dict, **_kw: object) -> None:  # just before our marker goes out
        if params.get("Key", "").endswith("/" + MARKER) and not fired:
            fired.append(params["Key"])
            with Checkpointer(s3_url) as ck:
                ck.save(1, {"w": torch.full((1 << 11,), 2.0)}).wait()

    client.meta.events.register("provide-client-params.s3.PutObject", winner)
    try:
        try:
            copy_checkpoint(open_storage(ours), dst)
            raise AssertionError("the copy committed over another checkpoint")
        except RefusedForSafety as e:
            assert "another writer committed step 1" in str(e), e
    finally:
        client.meta.events.unregister("provide-client-params.s3.PutObject", winner)
    assert fired
    won = read_committed_raw(dst)
    assert won.marker.manifest_name != MANIFEST  # the copy's manifest held the plain name
    named = {MARKER, won.marker.manifest_name, *(f.name for f in won.manifest.files)}
    assert {i.key for i in dst.list()} == named
    assert cli("verify", dst.url).exit_code == 0


def test_a_copy_writes_its_manifest_before_the_data_and_only_the_marker_after(tmp_path, s3_url):
    # The manifest is the source's bytes and commits nothing without the marker, so a copy
    # writes it beside its first look; after the data's last Complete only the marker is sent.
    # On main the manifest's PUT followed the Complete: two requests after the data.
    from ckptctl.format.layout import MARKER, step_dir
    from ckptctl.ops.transfer.copy import copy_checkpoint

    src = _one_step(str(tmp_path / "src"), elements=3 << 20)  # 12 MiB: a multipart upload
    dst = open_storage(s3_url, multipart_threshold=5 << 20, part_size=5 << 20)
    with request_log(dst._client.s3) as log:  # type: ignore[attr-defined]
        copy_checkpoint(open_storage(src), dst.sub(step_dir(1)))
    manifest = [i for i, e in enumerate(log) if e[0] == "sent" and e[2].endswith("/manifest.json")]
    parts = [i for i, e in enumerate(log) if e[0] == "sent" and e[1] == "UploadPart"]
    complete = max(i for i, e in enumerate(log) if e[0] == "answered" and e[1] == "CompleteMultipartUpload")
    assert len(manifest) == 1 and parts and manifest[0] < parts[0], log
    after = [(op, key.rsplit("/", 1)[-1]) for kind, op, key in log[complete:] if kind == "sent"]
    assert after == [("PutObject", MARKER)], after  # on main: the manifest, then the marker
    assert cli("verify", dst.url_of(step_dir(1))).exit_code == 0


def test_a_sync_over_a_mirror_asks_nothing_ahead_for_checkpoints_already_there(tmp_path, s3_url):
    # A copy into a destination expected empty asks its first questions beside the verdict; a
    # sync expects most checkpoints there already and asks for the verdict alone, so a sync
    # with nothing to do sends no uploads' listing per checkpoint (one for the root's
    # idle uploads, under its lock).
    root = str(tmp_path / "root")
    for step in (1, 2, 3):
        _one_step(root, step, elements=1 << 10)
    assert cli("sync", root, s3_url).exit_code == 0
    client = open_storage(s3_url)._client.s3  # type: ignore[attr-defined]
    with counting(client) as counts:
        r = cli("sync", root, s3_url)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert counts["ListMultipartUploads"] <= 1, counts  # a first look ahead per checkpoint: 4


def test_a_save_to_s3_creates_its_upload_beside_the_snapshot(tmp_path, s3_url):
    # save() waits for its marker look before it returns. The multipart upload of the shard is
    # now created beside the snapshot too: here the look waits until CreateMultipartUpload was
    # sent, which a save creating it only after save() returned (on main) never gets past.
    import torch

    from ckptctl import Checkpointer

    st = open_storage(s3_url, multipart_threshold=5 << 20, part_size=5 << 20)
    client = st._client.s3  # type: ignore[attr-defined]
    created = threading.Event()

    def create(**_kw: object) -> None:
        created.set()

    def marker(params: dict, **_kw: object) -> None:
        if params.get("Prefix", "").endswith("/COMMITTED") and not created.wait(10):
            raise AssertionError("the upload was created only after the marker's answer")

    client.meta.events.register("before-call.s3.CreateMultipartUpload", create)
    client.meta.events.register("provide-client-params.s3.ListObjectsV2", marker)
    try:
        with Checkpointer(s3_url, storage=st) as ck:
            ck.save(1, {"w": torch.arange(3 << 20, dtype=torch.float32)}).wait()  # 12 MiB: 3 parts
    finally:
        client.meta.events.unregister("before-call.s3.CreateMultipartUpload", create)
        client.meta.events.unregister("provide-client-params.s3.ListObjectsV2", marker)
    r = cli("verify", f"{s3_url}/step-0000000001")
    assert r.exit_code == 0, r.stdout + r.stderr


def test_a_refused_save_to_s3_leaves_no_upload_open(tmp_path, s3_url):
    # The early upload of a save that is then refused (its step is committed) is aborted.
    import pytest
    import torch

    from ckptctl import Checkpointer
    from ckptctl.errors import RefusedForSafety

    st = open_storage(s3_url, multipart_threshold=5 << 20, part_size=5 << 20)
    client = st._client.s3  # type: ignore[attr-defined]
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    with Checkpointer(s3_url, storage=st) as ck:
        ck.save(1, {"w": torch.zeros(3 << 20)}).wait()
        with counting(client) as counts:
            with pytest.raises(RefusedForSafety, match="already committed"):
                ck.save(1, {"w": torch.ones(3 << 20)})
    assert counts["CreateMultipartUpload"] == 1 and counts["AbortMultipartUpload"] == 1, counts
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
    r = cli("verify", f"{s3_url}/step-0000000001")
    assert r.exit_code == 0, r.stdout + r.stderr
