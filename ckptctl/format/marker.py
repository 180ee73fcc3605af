"""The commit marker. A checkpoint is committed if and only if its marker exists and records
the checksum and size of the manifest beside it.

It is written last, by one coordinator, atomically (``Storage.write_atomic``: temporary name,
fsync, rename, directory fsync; a single PUT on S3). Deleting a checkpoint removes it first.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.checksum import ALGORITHM, digest

MARKER_FORMAT = "ckptctl-commit"


@dataclass(frozen=True)
class Marker:
    step: int
    manifest_size: int
    manifest_checksum: str
    committed: float

    @classmethod
    def for_manifest(cls, step: int, manifest_bytes: bytes) -> "Marker":
        return cls(step, len(manifest_bytes), digest(manifest_bytes), time.time())

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": MARKER_FORMAT,
                "version": 1,
                "step": self.step,
                "manifest": {"size": self.manifest_size, "checksum": self.manifest_checksum, "algorithm": ALGORITHM},
                "committed": self.committed,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Marker":
        try:
            doc = json.loads(raw)
            if doc.get("format") != MARKER_FORMAT:
                raise ValueError("not a ckptctl marker")
            m = doc["manifest"]
            return cls(int(doc["step"]), int(m["size"]), str(m["checksum"]), float(doc["committed"]))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidCheckpoint(f"{where}: marker is garbled ({e})") from None

    def check(self, manifest_bytes: bytes, where: str) -> None:
        """Raise unless ``manifest_bytes`` is the manifest this marker committed."""
        if len(manifest_bytes) != self.manifest_size or digest(manifest_bytes) != self.manifest_checksum:
            raise InvalidCheckpoint(
                f"{where}: manifest does not match its marker (size {len(manifest_bytes)}, "
                f"marker expects {self.manifest_size})",
                hint="the manifest was replaced or truncated after commit; do not resume from it",
            )
