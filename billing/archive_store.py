"""Where the Parquet archive's files live: a local directory, or any fsspec URL.

Retention (``billing.archive``) needs one guarantee from where it writes: a file under its final
name is whole. The two kinds of storage give it differently, so each has its store:

- **A directory** (a mounted volume): a file is written to a ``.tmp`` name, flushed, renamed and
  its directory flushed, so a reader sees no file or the whole file, and a crash leaves at most
  a temp file behind.
- **An object store** (``s3://``, ``gs://``, ``az://``... any protocol fsspec knows, with its
  package installed): there is no rename, but an upload makes an object appear whole or not at
  all. A file is written on local disk first (DuckDB's ``COPY``), checksummed there, then
  uploaded under its final name, once; nothing is ever renamed or overwritten (every run's files
  carry the run's id).

The commit point is the same for both: a run's manifest, written after its files. Files no
manifest names are a stopped run's and are removed by the next one. Credentials for an object
store are the filesystem library's own (its environment variables, or the pod's identity):
the configuration names the URL only.

One retention runs at a time per archive: for a directory a lock file in it, across processes;
for a URL a lock file on this host (one ledger has one writer, on one host).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import duckdb
    from fsspec import AbstractFileSystem

__all__ = [
    "DirectoryStore",
    "Store",
    "UrlStore",
    "fsync_path",
    "is_url",
    "open_store",
    "readable",
    "sha256_of",
]

LOCK = "_lock"
_BLOCK = 1 << 20


def is_url(root: str | Path) -> bool:
    """Whether ``root`` names an fsspec URL rather than a local directory (``file://`` is local)."""
    text = str(root)
    return "://" in text and not text.startswith("file://")


def sha256_of(path: Path) -> str:
    """The SHA-256 of a local file, read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a directory, for a rename in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Make ``tmp`` durable under ``final``: flushed, renamed, the directory flushed."""
    fsync_path(tmp)
    os.replace(tmp, final)  # atomic on one filesystem: a reader sees the old name or the whole file
    fsync_path(final.parent)


def _is_temp(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.startswith(".") and name.endswith(".tmp")


class Store(Protocol):
    """What retention does with the archive's storage; paths are relative to the root, ``/``-separated."""

    @property
    def root(self) -> str:
        """What the ledger keeps as the archive's root: a file's location is ``root/rel``."""
        ...

    def lock(self) -> AbstractContextManager[None]:
        """Held for a whole retention run."""
        ...

    def staging(self, rel: str) -> Path:
        """A local path for the file that will be published as ``rel`` (DuckDB writes it)."""
        ...

    def publish(self, staged: Path, rel: str) -> None:
        """Make the whole of ``staged`` the file ``rel``; ``staged`` is gone afterwards."""
        ...

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``rel`` whole, or not at all."""
        ...

    def read_bytes(self, rel: str) -> bytes: ...

    def sha256(self, rel: str) -> str | None:
        """The file's SHA-256, or None when there is no such file."""
        ...

    def files(self, prefix: str) -> list[str]:
        """Every file under ``prefix``, relative to the root, sorted."""
        ...

    def remove(self, rel: str) -> None: ...

    def register(self, con: duckdb.DuckDBPyConnection) -> None:
        """Let DuckDB on ``con`` read the files by their locations."""
        ...


class DirectoryStore:
    """The archive as a local directory: published by flushed renames."""

    def __init__(self, base: Path) -> None:
        self.base = base.resolve()

    @property
    def root(self) -> str:
        return str(self.base)

    @contextmanager
    def lock(self) -> Iterator[None]:
        self.base.mkdir(parents=True, exist_ok=True)
        with (self.base / LOCK).open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
            yield

    def staging(self, rel: str) -> Path:
        final = self.base / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f".{final.name}.tmp")

    def publish(self, staged: Path, rel: str) -> None:
        _publish(staged, self.base / rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        tmp = self.staging(rel)
        tmp.write_bytes(data)
        self.publish(tmp, rel)

    def read_bytes(self, rel: str) -> bytes:
        return (self.base / rel).read_bytes()

    def sha256(self, rel: str) -> str | None:
        path = self.base / rel
        return sha256_of(path) if path.is_file() else None

    def files(self, prefix: str) -> list[str]:
        folder = self.base / prefix
        if not folder.is_dir():
            return []
        return sorted(p.relative_to(self.base).as_posix() for p in folder.rglob("*") if p.is_file())

    def remove(self, rel: str) -> None:
        (self.base / rel).unlink()

    def register(self, con: duckdb.DuckDBPyConnection) -> None:
        """Nothing to do: DuckDB reads local files itself."""


class UrlStore:
    """The archive at an fsspec URL (an object store): whole uploads, never a rename."""

    def __init__(self, url: str, fs: AbstractFileSystem, path: str) -> None:
        self.url = url.rstrip("/")
        self.fs = fs
        self.path = path.rstrip("/")  # the root as the filesystem names it, without its protocol
        self._staging = Path(tempfile.gettempdir()) / "infermeter-archive-staging"

    @property
    def root(self) -> str:
        return self.url

    @contextmanager
    def lock(self) -> Iterator[None]:
        key = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self._staging.mkdir(parents=True, exist_ok=True)
        with (self._staging / f"{key}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def staging(self, rel: str) -> Path:
        self._staging.mkdir(parents=True, exist_ok=True)
        return self._staging / f"{secrets.token_hex(8)}-{rel.rsplit('/', 1)[-1]}"

    def publish(self, staged: Path, rel: str) -> None:
        try:
            self.fs.put_file(str(staged), f"{self.path}/{rel}")
        finally:
            staged.unlink(missing_ok=True)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.path}/{rel}", data)

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(f"{self.path}/{rel}"))

    def sha256(self, rel: str) -> str | None:
        location = f"{self.path}/{rel}"
        if not self.fs.isfile(location):
            return None
        digest = hashlib.sha256()
        with self.fs.open(location, "rb") as f:
            for block in iter(lambda: f.read(_BLOCK), b""):
                digest.update(block)
        return digest.hexdigest()

    def files(self, prefix: str) -> list[str]:
        found = self.fs.find(f"{self.path}/{prefix}")
        base = self.path + "/"
        return sorted(str(p)[len(base) :] for p in found if str(p).startswith(base))

    def remove(self, rel: str) -> None:
        self.fs.rm_file(f"{self.path}/{rel}")

    def register(self, con: duckdb.DuckDBPyConnection) -> None:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if not set(protocols) & set(con.list_filesystems()):
            con.register_filesystem(self.fs)


def open_store(root: str | Path) -> Store:
    """The store of the archive at ``root``: a directory (or ``file://`` URL), or any fsspec URL."""
    text = str(root)
    if not is_url(text):
        return DirectoryStore(Path(text.removeprefix("file://")))
    import fsspec  # only archives at a URL need it

    fs, path = fsspec.core.url_to_fs(text)
    return UrlStore(text, fs, str(path))


def readable(con: duckdb.DuckDBPyConnection, locations: Sequence[str]) -> None:
    """Let DuckDB on ``con`` read every one of ``locations`` (the archive's files, at any root)."""
    roots = {loc.split("://", 1)[0] for loc in locations if is_url(loc)}
    for protocol in sorted(roots):
        open_store(f"{protocol}://").register(con)


def temp_name(rel: str) -> bool:
    """Whether ``rel`` is a stopped run's temp file (``DirectoryStore`` only writes those)."""
    return _is_temp(rel)
