"""A worker's store of unit files, named by SHA-256; a file held once is never fetched again.

Standard library only (workers stay light): files come over HTTP from the coordinator,
are hashed while they stream to a temporary name, and are renamed into place only if the
hash matches. A file already held is hashed again before it is used, once per process and
file version: the verdict is kept in memory and in a marker (``.verified/<sha>``) keyed by
the file's inode, size, mtime and ctime, so a file changed in place (ctime cannot be set
back) is hashed again; a file that no longer matches its name is deleted and fetched again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import urllib.request
from pathlib import Path

from ..model.manifest import HashMismatch

log = logging.getLogger("edgepipe.blobcache")


class BlobCache:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._verified: dict[str, str] = {}  # sha -> file stamp verified in this process
        self.ssl_context = None  # the pinned coordinator certificate, on a TLS cluster
        self.repaired: list[str] = []  # files found corrupt and deleted (to be fetched again)

    def path(self, sha: str) -> Path:
        return self.root / sha

    def has(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def held(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if len(p.name) == 64)

    def _stamp(self, sha: str) -> str | None:
        try:
            st = self.path(sha).stat()
        except FileNotFoundError:
            return None
        return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def verified(self, sha: str) -> bool:
        """True if the held file's SHA-256 is its name (hashing it only when this version of
        the file has not been verified before); a mismatching file is deleted."""
        stamp = self._stamp(sha)
        if stamp is None:
            return False
        marker = self.root / ".verified" / sha
        if self._verified.get(sha) == stamp:
            return True
        try:
            if marker.read_text() == stamp:
                self._verified[sha] = stamp
                return True
        except OSError:
            pass
        digest = hashlib.sha256()
        with open(self.path(sha), "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != sha:
            log.warning("cached blob %s… is corrupt (sha256 %s…): deleted, fetching it again", sha[:16], digest.hexdigest()[:16])
            self.path(sha).unlink(missing_ok=True)
            marker.unlink(missing_ok=True)
            self._verified.pop(sha, None)
            self.repaired.append(sha)
            return False
        self._mark(sha, stamp)
        return True

    def _mark(self, sha: str, stamp: str | None) -> None:
        if stamp is None:
            return
        self._verified[sha] = stamp
        marker = self.root / ".verified" / sha
        try:
            marker.parent.mkdir(exist_ok=True)
            tmp = marker.with_name(f".{sha}.{os.getpid()}")
            tmp.write_text(stamp)
            tmp.replace(marker)
        except OSError:
            pass  # a read-only marker directory only costs a re-hash in the next process

    def fetch(self, base_url: str, sha: str, headers: dict | None = None, timeout: float = 120, on_bytes=None) -> int:
        """Download one blob unless held intact; returns the bytes downloaded (0 when cached).
        ``on_bytes(n)`` is called for every chunk received (from this thread)."""
        if self.verified(sha):
            return 0
        tmp = self.root / f".{sha}.{os.getpid()}.part"
        digest = hashlib.sha256()
        size = 0
        request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/blobs/{sha}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self.ssl_context) as resp, open(tmp, "wb") as out:
                while chunk := resp.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                    if on_bytes is not None:
                        on_bytes(len(chunk))
            if digest.hexdigest() != sha:
                raise HashMismatch(f"blob {sha[:16]}… from {base_url}: sha256 is {digest.hexdigest()[:16]}…")
            tmp.replace(self.path(sha))
            self._mark(sha, self._stamp(sha))  # hashed while it streamed
        finally:
            tmp.unlink(missing_ok=True)
        return size
