"""A worker's store of unit files, named by SHA-256; a file held once is never fetched again.

Standard library only (workers stay light): files come over HTTP from the coordinator,
are hashed while they stream to a temporary name, and are renamed into place only if the
hash matches.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from pathlib import Path

from ..model.manifest import HashMismatch


class BlobCache:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha: str) -> Path:
        return self.root / sha

    def has(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def held(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if len(p.name) == 64)

    def fetch(self, base_url: str, sha: str, headers: dict | None = None, timeout: float = 120) -> int:
        """Download one blob unless held; returns the bytes downloaded (0 when cached)."""
        if self.has(sha):
            return 0
        tmp = self.root / f".{sha}.{os.getpid()}.part"
        digest = hashlib.sha256()
        size = 0
        request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/blobs/{sha}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp, open(tmp, "wb") as out:
                while chunk := resp.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            if digest.hexdigest() != sha:
                raise HashMismatch(f"blob {sha[:16]}… from {base_url}: sha256 is {digest.hexdigest()[:16]}…")
            tmp.replace(self.path(sha))
        finally:
            tmp.unlink(missing_ok=True)
        return size
