"""S3 Express One Zone's directory buckets, emulated in front of moto (which lets any bucket
take any request, whatever its name).

``DirectoryBuckets`` is a ``FaultProxy`` emulation: for a bucket whose name ends in ``--x-s3``
it answers, or refuses, or rewrites what AWS documents as different for directory buckets
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/s3-express-differences.html and the API
reference of each operation). botocore itself treats such a name as a directory bucket, also
behind a custom endpoint: it asks the bucket for a session (CreateSession, ``GET /b?session``)
and signs every request with it. So the requests judged here are exactly those our code and
botocore send to AWS. What it does, for such buckets only:

* CreateSession: answered here (moto does not know it) with throw-away credentials.
* ListObjectsV2 and ListMultipartUploads: refused (400 InvalidRequest) for a prefix that does
  not end in "/" (AWS's own code and message, as AWS answered it to another SDK), a delimiter
  other than "/", and ``start-after`` / ``upload-id-marker`` (not supported there; the error
  code is our guess). Answers list their entries shuffled (AWS: not in lexicographic order);
  ListMultipartUploads answers no NextUploadIdMarker. A delimited, single-page ListObjectsV2
  also names the prefixes only unfinished multipart uploads hold, as AWS documents.
* ListObjects (v1) and ListObjectVersions: refused (501 NotImplemented): not supported there.
* A request carrying Content-MD5: refused (400 InvalidRequest, the code our guess): directory
  buckets do not support MD5. CompleteMultipartUpload whose part numbers are not 1, 2, ...
  in a row: refused (400 InvalidPartOrder).

Not emulated: ETags stay moto's MD5s (AWS's are opaque there; nothing of ours reads them as
MD5s), and deleting the last object below a prefix removes AWS's "directory" with it, which
no listing can tell from a general-purpose bucket's.
"""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET
from typing import Callable, Mapping
from urllib.parse import parse_qs, quote, urlsplit

SUFFIX = "--x-s3"
_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
ET.register_namespace("", _NS)

Answer = tuple[int, str, bytes]  # status, reason, XML body
Refusal = tuple[int, str, str, str]  # status, reason, S3 error code, message
_BAD, _NOT_IMPLEMENTED = (400, "Bad Request"), (501, "Not Implemented")


_SESSION = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<CreateSessionResult xmlns="' + _NS + '"><Credentials>'
    "<SessionToken>emulated-session-token</SessionToken><SecretAccessKey>emulated-secret</SecretAccessKey>"
    "<AccessKeyId>EMULATEDSESSION</AccessKeyId><Expiration>2099-01-01T00:00:00Z</Expiration>"
    "</Credentials></CreateSessionResult>"
).encode()


class DirectoryBuckets:
    """The rules; ``refused`` records every request they refused, as (code, method, path)."""

    def __init__(self, seed: int = 0) -> None:
        self.refused: list[tuple[str, str, str]] = []
        self.sessions = 0
        self._random = random.Random(seed)

    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Answer | None:
        """An answer made here instead of moto's, or None to forward the request."""
        bucket, key, query = _split(path)
        if not bucket.endswith(SUFFIX):
            return None
        if method == "GET" and not key and "session" in query:
            self.sessions += 1
            return 200, "OK", _SESSION
        refusal = self._refusal(method, key, query, headers, body)
        if refusal is None:
            return None
        status, reason, code, message = refusal
        self.refused.append((code, method, path))
        return status, reason, (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                                "</Message><RequestId>directory-bucket-emulation</RequestId></Error>").encode()

    def rewrite(self, method: str, path: str, payload: bytes, get: Callable[[str], bytes]) -> bytes:
        """moto's answer as a directory bucket gives it; ``get`` asks moto for another path."""
        bucket, key, query = _split(path)
        if not bucket.endswith(SUFFIX) or method != "GET" or key:
            return payload
        if query.get("list-type") == ["2"]:
            root = ET.fromstring(payload)
            if query.get("delimiter") and not query.get("continuation-token") and root.findtext(f"{{{_NS}}}IsTruncated") != "true":
                self._add_upload_prefixes(root, bucket, query, get)
            return self._shuffled(root, ("Contents", "CommonPrefixes"))
        if "uploads" in query:
            root = ET.fromstring(payload)
            for marker in root.findall(f"{{{_NS}}}NextUploadIdMarker"):
                root.remove(marker)
            return self._shuffled(root, ("Upload", "CommonPrefixes"))
        return payload

    def _refusal(self, method: str, key: str, query: dict[str, list[str]], headers: Mapping[str, str],
                 body: bytes) -> Refusal | None:
        if any(name.lower() == "content-md5" for name in headers):
            return *_BAD, "InvalidRequest", "Content-MD5 is not supported by directory buckets."
        if method == "GET" and not key and "session" not in query:
            if "versions" in query or ("list-type" not in query and "uploads" not in query):
                return *_NOT_IMPLEMENTED, "NotImplemented", "This bucket does not support this operation."
            prefix, delimiter = query.get("prefix", [""])[0], query.get("delimiter", [None])[0]
            if prefix and not prefix.endswith("/"):
                return (*_BAD, "InvalidRequest", "This bucket does not support a prefix that does not end in a "
                        "delimiter. Specify a prefix path ending with a delimiter and try again.")
            if delimiter is not None and delimiter != "/":
                return *_BAD, "InvalidRequest", "This bucket supports only / as the delimiter."
            if "start-after" in query or "upload-id-marker" in query:
                return *_BAD, "InvalidRequest", "This bucket does not support this parameter."
        if method == "POST" and "uploadId" in query:
            numbers = [int(n.text or "0") for n in ET.fromstring(body).iter() if n.tag.endswith("PartNumber")]
            if numbers != list(range(1, len(numbers) + 1)):
                return *_BAD, "InvalidPartOrder", "Part numbers must be 1, 2, ... in a row."
        return None

    def _add_upload_prefixes(self, root: ET.Element, bucket: str, query: dict[str, list[str]],
                             get: Callable[[str], bytes]) -> None:
        prefix = query.get("prefix", [""])[0]
        encoded = query.get("encoding-type") == ["url"]
        have = {p.findtext(f"{{{_NS}}}Prefix") for p in root.findall(f"{{{_NS}}}CommonPrefixes")}
        uploads = ET.fromstring(get(f"/{bucket}?uploads&prefix={quote(prefix, safe='')}"))
        for upload in uploads.findall(f"{{{_NS}}}Upload"):
            rest = (upload.findtext(f"{{{_NS}}}Key") or "")[len(prefix):]
            if "/" not in rest:
                continue
            held = prefix + rest.split("/", 1)[0] + "/"
            shown = quote(held, safe="/") if encoded else held
            if shown not in have:
                have.add(shown)
                ET.SubElement(ET.SubElement(root, f"{{{_NS}}}CommonPrefixes"), f"{{{_NS}}}Prefix").text = shown

    def _shuffled(self, root: ET.Element, tags: tuple[str, ...]) -> bytes:
        for tag in tags:
            items = root.findall(f"{{{_NS}}}{tag}")
            for item in items:
                root.remove(item)
            order = items[:]
            self._random.shuffle(order)
            if len(order) > 1 and order == items:  # moto's (sorted) order, by chance: never that
                order.reverse()
            root.extend(order)
        return ET.tostring(root, xml_declaration=True, encoding="UTF-8")


def _split(path: str) -> tuple[str, str, dict[str, list[str]]]:
    """A path-style request's bucket, key and query (values decoded, blank ones kept)."""
    parts = urlsplit(path)
    bucket, _, key = parts.path.lstrip("/").partition("/")
    return bucket, key, parse_qs(parts.query, keep_blank_values=True)
