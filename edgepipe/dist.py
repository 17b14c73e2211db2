"""This edgepipe as a wheel, so that a machine joining the coordinator installs the very code the
coordinator runs, from the coordinator, with no package index for edgepipe itself.

From a source tree (a clone, an editable install: ``pyproject.toml`` beside the package) the
wheel is built by ``pip wheel --no-deps`` from a copy of the tree (the checkout gets no
``build/``); from an installed wheel it is packed again from the installed files its ``RECORD``
lists. Either way it is made once per source hash and kept under ``cache_dir``. Its
dependencies (onnxruntime, numpy, websockets, ...) come from the package registry as usual.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SKIP = re.compile(r"(^|/)__pycache__(/|$)|\.(pyc|pyo|so|dylib|dll)$")  # build outputs: not source


@dataclass(frozen=True)
class Source:
    """Where this edgepipe's wheel is made from: a source tree (``root``) or the installed files."""

    version: str
    files: tuple[tuple[str, Path], ...]  # (path in the tree or wheel, file here), sorted
    root: Path | None  # the source tree, None for an installed distribution

    @property
    def wheel_version(self) -> str:
        """The version the wheel carries: a source tree's with its hash as the local label
        (``0.1.0+1a2b3c4d5e6f``), so that a machine holding an older build of the same version
        is updated by the same pip line; an installed one's as installed."""
        return self.version if self.root is None else f"{self.version}+{self.digest()[:12]}"

    @property
    def wheel_name(self) -> str:
        return wheel_name(self.wheel_version)

    def digest(self) -> str:
        """sha256 over every file's path and bytes: a changed tree makes another wheel (kept per
        file sizes and times, so a request does not read the tree again)."""
        stats = tuple((rel, path.stat().st_size, path.stat().st_mtime_ns) for rel, path in self.files)
        if stats not in _digests:
            h = hashlib.sha256(self.version.encode())
            for rel, path in self.files:
                h.update(rel.encode() + b"\0")
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                h.update(b"\0")
            _digests.clear()  # one tree per process
            _digests[stats] = h.hexdigest()
        return _digests[stats]


_digests: dict[tuple, str] = {}


def wheel_name(version: str) -> str:
    return f"edgepipe-{version.replace('-', '_')}-py3-none-any.whl"


def source_tree() -> Path | None:
    """The source tree this edgepipe is imported from (a clone or an editable install), or None."""
    root = PACKAGE.parent
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return None
    import tomllib

    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return root if project.get("name") == "edgepipe" else None


def find_source() -> Source:
    root = source_tree()
    if root is not None:
        import tomllib

        version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
        files = [("pyproject.toml", root / "pyproject.toml")]
        if (root / "README.md").is_file():  # the project's readme (pyproject names it)
            files.append(("README.md", root / "README.md"))
        for path in sorted(PACKAGE.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and not SKIP.search(rel):
                files.append((rel, path))
        return Source(version, tuple(files), root)
    from importlib.metadata import distribution

    return installed_source(distribution("edgepipe"))


def installed_source(dist) -> Source:
    """The files of an installed (not editable) edgepipe, as its ``RECORD`` lists them."""
    files = []
    for entry in dist.files or ():
        rel = entry.as_posix()
        if rel.startswith("edgepipe/") and not SKIP.search(rel) or _dist_info_kept(rel):
            files.append((rel, Path(entry.locate())))
    return Source(dist.version, tuple(sorted(files)), None)


def _dist_info_kept(rel: str) -> bool:
    """The ``.dist-info`` files a wheel carries (not what pip wrote on install: RECORD, INSTALLER, ...)."""
    head, _, name = rel.partition("/")
    return head.endswith(".dist-info") and (name in ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt")
                                            or name.startswith("licenses/"))


_lock = threading.Lock()


def build_wheel(cache_dir: Path, source: Source | None = None) -> Path:
    """This edgepipe's wheel under ``cache_dir/<source sha256>/``, made on first use (minutes at
    most: seconds from an installed wheel, a ``pip wheel`` from a source tree)."""
    source = source or find_source()
    target = Path(cache_dir) / source.digest()[:32] / source.wheel_name
    with _lock:
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="edgepipe-wheel-") as work:
            made = _pip_wheel(source, Path(work)) if source.root is not None else _repack(source, Path(work))
            os.replace(made, target)  # whole or not at all: another process may serve the same cache
    return target


def _pip_wheel(source: Source, work: Path) -> Path:
    tree = work / "src"
    for rel, path in source.files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, tree / rel)
    pyproject = tree / "pyproject.toml"  # the copy carries the version with the source's hash
    text, n = re.subn(r'(?m)^version\s*=\s*"[^"]*"', f'version = "{source.wheel_version}"', pyproject.read_text(), count=1)
    if n != 1:
        raise RuntimeError("pyproject.toml names no version")
    pyproject.write_text(text)
    have_setuptools = _importable("setuptools")
    # with setuptools here, build offline with it; else pip fetches the build backend (isolated)
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check", "-w", str(work / "out"), str(tree),
            *(["--no-build-isolation"] if have_setuptools else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    built = work / "out" / source.wheel_name
    if done.returncode != 0 or not built.is_file():
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise RuntimeError(f"building the edgepipe wheel failed: {last[0][:300]}")
    return built


def _importable(name: str) -> bool:
    from importlib.util import find_spec

    return find_spec(name) is not None


def _repack(source: Source, work: Path) -> Path:
    """A wheel of the installed files (the ones its RECORD lists), with a new RECORD."""
    out = work / source.wheel_name
    info = next(rel.split("/")[0] for rel, _ in source.files if rel.split("/")[0].endswith(".dist-info"))
    record = io.StringIO()
    rows = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as whl:
        for rel, path in source.files:
            data = path.read_bytes()
            whl.writestr(rel, data)
            rows.writerow([rel, "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode(), len(data)])
        rows.writerow([f"{info}/RECORD", "", ""])
        whl.writestr(f"{info}/RECORD", record.getvalue())
    return out


def wheel_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def default_cache() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("EDGEPIPE_DIST_CACHE") or Path(user_cache_dir("edgepipe")) / "dist")


def join_commands(base_url: str, wheel: str, sha256: str | None, join_token: str | None, fingerprint: str | None) -> list[str]:
    """The commands another machine runs to join the coordinator at ``base_url`` (``http(s)://host:port``,
    an address that machine can reach): install this very edgepipe from it, then start a worker."""
    from urllib.parse import urlsplit

    url = f"{base_url}/dist/{wheel}" + (f"#sha256={sha256}" if sha256 else "")  # pip checks the hash of what it fetched
    trusted = f"--trusted-host {urlsplit(base_url).netloc} " if base_url.startswith("https://") else ""  # a self-signed certificate: the hash is the check
    worker = f"edgepipe worker --coordinator {base_url}"
    if fingerprint:
        worker += f" --tls-fingerprint {fingerprint}"
    if join_token:
        worker += f" --join-token {join_token}"
    return [f'pip install {trusted}"{url}"', worker]
