"""The commit marker. A checkpoint is committed if and only if its marker exists and records
the checksum and size of the manifest beside it.

It is written last, by one coordinator, and only if absent (``Storage.write_if_absent``: a
hard link of a fsynced temporary file, or ``If-None-Match: *`` on S3), so a second writer of
the same step can never replace it. Deleting a checkpoint removes it first.

The manifest it commits is ``manifest.json`` unless the marker names another
(``"manifest": {"name": "manifest.<save id>.json"}``, written only then): a save whose
``manifest.json`` was taken by another attempt publishes its own under its attempt's name.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import parse
from ckptctl.format.checksum import ALGORITHM, digest
from ckptctl.format.layout import MANIFEST, is_manifest_name
from ckptctl.format.manifest import MAX_MANIFEST_BYTES

MARKER_FORMAT = "ckptctl-commit"
MARKER_VERSION = 1
MAX_MARKER_BYTES = 1 << 20  # a marker is ~200 bytes; anything near this is not a marker


@dataclass(frozen=True)
class Marker:
    step: int
    manifest_size: int
    manifest_checksum: str
    committed: float
    manifest_name: str = MANIFEST  # the file, beside the marker, that it commits

    @classmethod
    def for_manifest(cls, step: int, manifest_bytes: bytes, manifest_name: str = MANIFEST) -> "Marker":
        return cls(step, len(manifest_bytes), digest(manifest_bytes), time.time(), manifest_name)

    def to_json(self) -> bytes:
        manifest: dict[str, object] = {"size": self.manifest_size, "checksum": self.manifest_checksum, "algorithm": ALGORITHM}
        if self.manifest_name != MANIFEST:  # else the bytes of every marker before save ids
            manifest["name"] = self.manifest_name
        return json.dumps(
            {
                "format": MARKER_FORMAT,
                "version": MARKER_VERSION,
                "step": self.step,
                "manifest": manifest,
                "committed": self.committed,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Marker":
        """Parse and validate; every problem raises InvalidCheckpoint naming ``where``. Keys this
        version does not know are ignored; a higher ``version`` is refused."""
        doc = parse.load_json(raw, where, "commit marker", max_bytes=MAX_MARKER_BYTES, max_depth=8)
        top = parse.Obj(doc, where, "commit marker")
        if doc.get("format") != MARKER_FORMAT:
            raise parse.invalid(where, f"not a ckptctl commit marker (no \"format\": \"{MARKER_FORMAT}\")")
        parse.check_version(doc, where, "commit marker", supported=MARKER_VERSION)
        m = top.obj("manifest", "commit marker: 'manifest'")
        algorithm = m.str("algorithm", max_len=64, default=ALGORITHM)
        if algorithm != ALGORITHM:
            raise m.bad("algorithm", f"is {algorithm!r}, not {ALGORITHM!r}")
        name = m.str("name", max_len=64, default=MANIFEST)
        if not is_manifest_name(name):
            raise m.bad("name", f"{name!r} is not manifest.json or manifest.<16 hex digits>.json")
        return cls(
            step=top.int("step", lo=0, hi=parse.INT64_MAX),
            manifest_size=m.int("size", lo=0, hi=MAX_MANIFEST_BYTES),
            manifest_checksum=m.str("checksum", max_len=128),
            committed=top.float("committed", lo=0.0, hi=parse.MAX_TIME),
            manifest_name=name,
        )

    def check(self, manifest_bytes: bytes, where: str) -> None:
        """Raise unless ``manifest_bytes`` is the manifest this marker committed."""
        if len(manifest_bytes) != self.manifest_size:
            differs = f"size {len(manifest_bytes)}, marker expects {self.manifest_size}"
        elif digest(manifest_bytes) != self.manifest_checksum:
            differs = f"same size, {self.manifest_size} bytes, but another checksum"  # bytes changed in place
        else:
            return
        raise InvalidCheckpoint(
            f"{where}: manifest does not match its marker ({differs})",
            hint="the manifest was replaced or truncated after commit; do not resume from it",
        )
