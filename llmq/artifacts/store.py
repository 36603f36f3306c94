"""A directory of immutable, versioned artifacts: `<store>/<name>/v<N>/` with payload files and `llmq.json`.

Writers fill a hidden staging directory beside the versions and rename it into place, so readers never see a
half-written artifact, and two concurrent writers of one name end up with distinct versions: rename onto an
existing non-empty directory fails, and the loser simply takes the next number. A staging directory is named after
its writer's host and process, so one left behind by a killed writer is removed when the store is next opened on the
same host, once that process is gone (never one of another host's, whose processes we cannot see).

Writers hash every file; loads check sizes and per-file stamps kept in `<store>/.stamps/` and re-hash only files
whose stamp no longer matches (stamps.py); `Artifact.verify(full=True)` (`llmq verify`) re-hashes everything.
"""

from __future__ import annotations

import builtins  # annotations in Store, whose own `list` method shadows the type there
import errno
import os
import re
import shutil
import socket
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import manifest as mf
from . import stamps
from .hashing import MANIFEST_NAME, content_id, payload_files

ENV_STORE = "LLMQ_STORE"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION_DIR = re.compile(r"^v(\d+)$")
_REF_VERSION = re.compile(r"^(?P<name>[^/@]+)[/@]v(?P<version>\d+)$")
_HEX = re.compile(r"^(sha256:)?[0-9a-f]{6,64}$")
_STAGING = re.compile(r"^\.staging-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{32}$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove_abandoned_staging(name_dir: Path) -> None:
    """Delete staging directories under `name_dir` whose writer (a process on this host) no longer exists."""
    if not name_dir.is_dir():
        return
    for p in name_dir.iterdir():
        m = _STAGING.match(p.name)
        if m and m["host"] == _host() and not _alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)


class ArtifactError(Exception):
    """An artifact is missing, damaged or ambiguous. Carries one line fit for the user."""


class ArtifactNotFound(ArtifactError):
    """No artifact answers to a reference (as opposed to one that exists but is damaged)."""


class ManifestDamaged(ArtifactError):
    """An artifact whose `llmq.json` is unreadable, malformed or edited; `claimed_id` is the id it states, if any."""

    def __init__(self, message: str, claimed_id: str | None = None):
        super().__init__(message)
        self.claimed_id = claimed_id


def default_store_path() -> Path:
    env = os.environ.get(ENV_STORE)
    if env:
        return Path(env).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "llmq" / "store"


def validate_name(name: str) -> str:
    if not _NAME.match(name):
        raise ArtifactError(f"invalid artifact name {name!r}: use letters, digits, '.', '_' and '-' (max 128)")
    return name


@dataclass(frozen=True)
class Artifact:
    """A committed artifact directory and its manifest; `stamp` is where its stamp lives (None: it has none)."""

    path: Path
    manifest: dict
    stamp: Path | None = field(default=None, compare=False, repr=False)

    id = property(lambda self: self.manifest["id"])
    kind = property(lambda self: self.manifest["kind"])
    name = property(lambda self: self.manifest["name"])
    version = property(lambda self: self.manifest["version"])
    parents = property(lambda self: list(self.manifest["parents"]))
    config = property(lambda self: self.manifest.get("config", {}))
    metrics = property(lambda self: self.manifest.get("metrics", {}))
    payload_bytes = property(lambda self: sum(f["size"] for f in self.manifest["files"].values()))
    ref = property(lambda self: f"{self.name}/v{self.version}")

    @classmethod
    def load(cls, path: Path | str, verify: bool = True, stamp: Path | None = None) -> "Artifact":
        path = Path(path)
        try:
            data = mf.read(path / MANIFEST_NAME)
        except mf.ManifestError as e:
            raise ManifestDamaged(str(e), e.claimed_id) from None
        art = cls(path, data, stamp)
        if verify:
            art.verify()
        return art

    def verify(self, full: bool = False) -> int:
        """Check the payload against the manifest; return how many files were re-hashed.

        First, before reading any content: every file is present with its manifest size, there are no stray files,
        and the id matches the file hashes; each defect is an error naming the file. Then the contents: with `full`
        (`llmq verify REF`) every file is re-hashed. Otherwise (every load) a file whose stamp still matches (same
        device, inode, size and mtime as when it was last hashed; see stamps.py) is trusted without being read, and
        only the others are re-hashed, after which the stamp is refreshed: the first load of a copied artifact reads
        everything once, later loads read nothing. Trade-off: a flipped byte that leaves size and mtime alone (bit
        rot, or a tool that restores the mtime) is not caught by a load, only by `llmq verify`. A hash mismatch
        also deletes the stamp, so later loads re-hash and refuse too.
        """
        files = self.manifest["files"]
        stats = {}
        for rel, meta in files.items():
            p = self.path / rel
            if not p.is_file():
                raise ArtifactError(f"artifact {self.ref} is damaged: file {rel} is missing ({self.path})")
            stats[rel] = st = p.stat()
            if st.st_size != meta["size"]:
                raise ArtifactError(f"artifact {self.ref} is damaged: file {rel} has size {st.st_size}, "
                                    f"manifest says {meta['size']}")
        extra = [p.relative_to(self.path).as_posix() for p in self.path.rglob("*")
                 if p.is_file() and p.name != MANIFEST_NAME and p.relative_to(self.path).as_posix() not in files]
        if extra:
            raise ArtifactError(f"artifact {self.ref} is damaged: unexpected file {sorted(extra)[0]}")
        if content_id(files) != self.id:
            raise ArtifactError(f"artifact {self.ref} is damaged: its id does not match its files")
        old = {} if full else stamps.read(self.stamp, self.id)
        new, hashed = {}, 0
        for rel, meta in files.items():
            if stamps.matches(old.get(rel), stats[rel], meta["sha256"]):
                new[rel] = old[rel]
                continue
            digest, entry = stamps.hash_file(self.path / rel)
            hashed += 1
            if digest != meta["sha256"]:
                stamps.remove(self.stamp)
                raise ArtifactError(f"artifact {self.ref} is damaged: file {rel} does not match its sha256")
            if entry is not None:
                new[rel] = entry
        if hashed:
            stamps.write(self.stamp, self.id, new)
        return hashed

    def file(self, rel: str) -> Path:
        return self.path / rel


@dataclass
class ArtifactWriter:
    """Context manager that stages payload files and commits them as the next version of `name`."""

    store: "Store"
    kind: str
    name: str
    parents: list[str]
    config: dict
    command: str | None
    needs: int = 0  # about how many bytes the payload will take: refused up front where the device has less
    metrics: dict = field(default_factory=dict)
    artifact: Artifact | None = None

    def __post_init__(self):
        self.dir = self.store.root / self.name / f".staging-{_host()}-{os.getpid()}-{uuid.uuid4().hex}"

    def __enter__(self) -> "ArtifactWriter":
        _remove_abandoned_staging(self.dir.parent)
        if self.needs:
            existing = next(p for p in (self.dir, *self.dir.parents) if p.exists())
            free = shutil.disk_usage(existing).free
            if free < self.needs:
                raise ArtifactError(f"{self.name} needs about {self.needs / 2**20:,.0f} MiB but the device of "
                                    f"{self.store.root} has {free / 2**20:,.0f} MiB free: free space, or point --store "
                                    "(LLMQ_STORE) elsewhere")
        self.dir.mkdir(parents=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.artifact = self._commit()
                return
            except BaseException as e:
                exc = e
        self._discard()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:  # anywhere in the stage: one line, nothing left
            raise ArtifactError(f"no space left on the device of {self.store.root} while writing {self.name}; "
                                "nothing was kept: free space, or point --store (LLMQ_STORE) elsewhere") from None
        if exc_type is None:
            raise exc

    def _discard(self) -> None:
        """Remove the staged files, and the name's directory where this writer was its only content."""
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.dir.parent.rmdir()
        except OSError:
            pass  # it holds other versions, or another writer's staging

    def _commit(self) -> Artifact:
        files, entries = {}, {}
        for p in payload_files(self.dir):
            rel = p.relative_to(self.dir).as_posix()
            digest, entry = stamps.hash_file(p)
            files[rel] = {"sha256": digest, "size": p.stat().st_size}
            if entry is not None:
                entries[rel] = entry
        if not files:
            raise ArtifactError(f"refusing to write artifact {self.name}: it has no payload files")
        cid = content_id(files)
        for p in self.dir.rglob("*"):
            if p.is_file():
                p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        while True:
            version = self.store.latest_version(self.name) + 1
            manifest = mf.build(kind=self.kind, name=self.name, version=version, id=cid, parents=self.parents,
                                command=self.command, config=self.config, files=files, metrics=self.metrics)
            mf.write(self.dir / MANIFEST_NAME, manifest)
            target = self.store.root / self.name / f"v{version}"
            try:
                os.rename(self.dir, target)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    continue  # another writer took this version first
                raise
            stamp = self.store.stamp_path(self.name, version)
            stamps.write(stamp, cid, entries)  # after the rename, which keeps inodes and mtimes
            return Artifact(target, manifest, stamp)


class Store:
    """The artifact store rooted at a directory."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser()

    @classmethod
    def open(cls, path: Path | str | None = None) -> "Store":
        """The store at `path` (default: LLMQ_STORE or the user's data directory), rid of the staging directories
        killed writers of this host left behind (not only at the next write of their name)."""
        store = cls(path if path is not None else default_store_path())
        if store.root.is_dir():
            for d in store.root.iterdir():
                if _NAME.match(d.name):
                    _remove_abandoned_staging(d)
        return store

    def create(self, kind: str, name: str, parents: builtins.list[str] | None = None, config: dict | None = None,
               command: str | None = None, needs: int = 0) -> ArtifactWriter:
        """The writer of the next version of `name`; `needs`: the payload's estimated bytes, checked against the free
        space before anything is written (a long stage fails at its start, not after minutes)."""
        if kind not in mf.KINDS:
            raise ArtifactError(f"unknown artifact kind {kind!r} (kinds: {', '.join(mf.KINDS)})")
        return ArtifactWriter(self, kind, validate_name(name), list(parents or []), dict(config or {}), command, needs)

    def versions(self, name: str) -> builtins.list[int]:
        d = self.root / name
        if not d.is_dir():
            return []
        return sorted(int(m.group(1)) for p in d.iterdir() if (m := _VERSION_DIR.match(p.name)))

    def stamp_path(self, name: str, version: int) -> Path:
        """Where the stamp of `<name>/v<version>` lives: beside the versions, never inside an artifact (stamps.py)."""
        return self.root / stamps.STAMP_DIR / name / f"v{version}.json"

    def _stamp_of(self, path: Path) -> Path | None:
        """The stamp of an artifact directory given by path, if it is one of this store's `<name>/v<N>`."""
        try:
            real, root = path.resolve(), self.root.resolve()
        except OSError:
            return None
        m = _VERSION_DIR.match(real.name)
        if m and real.parent.parent == root and _NAME.match(real.parent.name):
            return self.stamp_path(real.parent.name, int(m.group(1)))
        return None

    def latest_version(self, name: str) -> int:
        v = self.versions(name)
        return v[-1] if v else 0

    def names(self) -> builtins.list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and _NAME.match(p.name) and self.versions(p.name))

    def list(self, kind: str | None = None, damaged: builtins.list | None = None) -> builtins.list[Artifact]:
        """All artifacts, manifests read and checked but payloads not hashed (use resolve() for a verified one).

        One damaged manifest must not hide the rest of the store: it is skipped, and appended to `damaged` as
        (ref, ManifestDamaged) when a list is given."""
        out = []
        for name in self.names():
            for v in self.versions(name):
                try:
                    art = Artifact.load(self.root / name / f"v{v}", verify=False, stamp=self.stamp_path(name, v))
                except ManifestDamaged as e:
                    if damaged is not None:
                        damaged.append((f"{name}/v{v}", e))
                    continue
                if kind is None or art.kind == kind:
                    out.append(art)
        return out

    def by_id(self, prefix: str, verify: bool = True) -> Artifact:
        """The artifact whose id starts with `prefix`; a damaged one claiming that id is an error, not a miss."""
        prefix = prefix.removeprefix("sha256:")
        damaged = []
        hits = [a for a in self.list(damaged=damaged) if a.id.startswith(prefix)]
        if not hits:
            for _, e in damaged:
                if e.claimed_id and e.claimed_id.startswith(prefix):
                    raise e
            raise ArtifactNotFound(f"no artifact with id {prefix} in store {self.root}")
        if len({a.id for a in hits}) > 1:
            raise ArtifactError(f"id prefix {prefix} is ambiguous: {', '.join(a.ref for a in hits)}")
        if verify:
            hits[0].verify()
        return hits[0]

    def resolve(self, ref: str, verify: bool = True) -> Artifact:
        """Find an artifact by `name`, `name/vN`, directory path or id prefix; verify its files."""
        ref = str(ref)
        p = Path(ref).expanduser()
        if (p / MANIFEST_NAME).is_file():
            return Artifact.load(p, verify=verify, stamp=self._stamp_of(p))
        if m := _REF_VERSION.match(ref):
            d = self.root / m["name"] / f"v{int(m['version'])}"
            if not d.is_dir():
                have = ", ".join(f"v{v}" for v in self.versions(m["name"])) or "none"
                raise ArtifactNotFound(f"no version v{m['version']} of {m['name']!r} in store {self.root} "
                                       f"(have: {have})")
            return Artifact.load(d, verify=verify, stamp=self._stamp_of(d))
        if _NAME.match(ref) and self.versions(ref):
            v = self.latest_version(ref)
            return Artifact.load(self.root / ref / f"v{v}", verify=verify, stamp=self.stamp_path(ref, v))
        if _HEX.match(ref):
            return self.by_id(ref, verify=verify)
        raise ArtifactNotFound(f"no artifact {ref!r} in store {self.root} ('llmq ls' lists what is there)")

    def children(self, art: Artifact, kind: str | None = None) -> builtins.list[Artifact]:
        """The artifacts made from `art` (it is their first parent), of `kind` if given, the newest first."""
        kids = [a for a in self.list(kind=kind) if a.parents[:1] == [art.id]]
        return sorted(kids, key=lambda a: a.manifest.get("created", ""), reverse=True)

    def lineage(self, art: Artifact) -> builtins.list[Artifact]:
        """The chain from `art` back to its source, following first parents; a missing parent ends the chain, a damaged
        one is an error."""
        chain, seen = [art], {art.id}
        while chain[-1].parents:
            pid = chain[-1].parents[0]
            if pid in seen:
                break
            try:
                parent = self.by_id(pid, verify=False)
            except ArtifactNotFound:
                break
            chain.append(parent)
            seen.add(pid)
        return chain
