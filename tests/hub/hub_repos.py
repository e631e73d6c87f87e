"""The repos a FakeHub serves (fake_hub.py): files with the ids the Hub gives them (git
blob sha1, LFS sha256), commits, branches, tree listings, Range headers and error
answers."""

from __future__ import annotations

import hashlib
import pathlib
from dataclasses import dataclass, field

# What the Hub's default .gitattributes puts in LFS; it also stores any file over 10 MiB
# there. An LFS file's ETag is its sha256, any other file's its git blob sha1.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".gguf",
                ".model", ".npz", ".ckpt")
LFS_MIN_SIZE = 10 * 1024 * 1024


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class RepoFile:
    path: str
    data: bytes
    blob_id: str  # git oid of what git stores: the file, or its LFS pointer
    sha256: str | None  # set for LFS files
    pointer_size: int | None

    @classmethod
    def make(cls, path: str, data: bytes) -> RepoFile:
        if not (path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE):
            return cls(path, data, _git_blob_id(data), None, None)
        sha256 = hashlib.sha256(data).hexdigest()
        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
                   f"size {len(data)}\n").encode()
        return cls(path, data, _git_blob_id(pointer), sha256, len(pointer))

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.blob_id, "size": len(self.data), "path": self.path}
        if self.sha256 is not None:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data),
                            "pointerSize": self.pointer_size}
        return entry


@dataclass
class Repo:
    repo_id: str
    token: str | None = None
    private: bool = False
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit sha
    commits: dict[str, dict[str, RepoFile]] = field(default_factory=dict)  # sha -> files

    def resolve(self, revision: str) -> str:
        sha = self.branches.get(revision, revision)
        if sha not in self.commits:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha


class HubError(Exception):
    """An error answer: status, the X-Error-Code header (None: no code) and message."""

    def __init__(self, status: int, code: str | None, message: str,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


def read_dir(path: pathlib.Path) -> dict[str, RepoFile]:
    files = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and not rel.startswith(".git/"):
            files[rel] = RepoFile.make(rel, p.read_bytes())
    return files


def commit_sha(repo_id: str, files: dict[str, RepoFile]) -> str:
    """A deterministic 40-hex commit id: the same files in a repo give the same commit."""
    h = hashlib.sha1(f"commit {repo_id}\0".encode())
    for path, f in sorted(files.items()):
        h.update(f"{path}\0{f.blob_id}\0".encode())
    return h.hexdigest()


def listing(files: dict[str, RepoFile], prefix: str, recursive: bool) -> list[dict] | None:
    """Tree entries under `prefix` ("" is the root), or None when it is no directory."""
    base = prefix + "/" if prefix else ""
    dirs: set[str] = set()
    entries = []
    for path, f in files.items():
        if not path.startswith(base):
            continue
        parts = path[len(base):].split("/")
        depth = len(parts) if recursive else 1
        for i in range(1, min(depth, len(parts) - 1) + 1):
            dirs.add(base + "/".join(parts[:i]))
        if recursive or len(parts) == 1:
            entries.append(f.tree_entry())
    if prefix and not entries and not dirs:
        return None
    entries += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                 "path": d} for d in dirs]
    return sorted(entries, key=lambda e: e["path"])


def byte_range(header: str | None, size: int) -> tuple[int | None, int]:
    """(start, end) of a `Range: bytes=a-b` / `bytes=a-` / `bytes=-n` header, both ends
    inclusive; (None, size - 1) without one (or one this server does not parse)."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None, size - 1
    first, _, last = header[len("bytes="):].strip().partition("-")
    if not first:
        return (max(size - int(last), 0), size - 1) if last.isdigit() else (None, size - 1)
    if not first.isdigit():
        return None, size - 1
    end = min(int(last), size - 1) if last.isdigit() else size - 1
    return int(first), end
