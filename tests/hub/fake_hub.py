"""A local stand-in for the Hugging Face Hub's download routes, driven by the real
huggingface_hub client (HF_ENDPOINT=hub.endpoint): repo info, tree listing, resolve
(HEAD, GET, Range), gated and private repos, and the Hub's error headers. The routes and
headers are the ones huggingface_hub reads (hf_api.py, file_download.py, utils/_http.py);
files are served over plain HTTP, never Xet (no X-Xet-Hash header, no xetHash field)."""

from __future__ import annotations

import contextlib
import json
import mimetypes
import pathlib
import socket
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from hub_repos import HubError, Repo, RepoFile, byte_range, commit_sha, listing, read_dir

_NO_AGENTS = {"standardEnvVars": [], "harnesses": {}}  # /api/agent-harnesses (telemetry)


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str  # percent-decoded, without the query
    query: str
    headers: dict[str, str]  # lower-case names
    status: int


class FakeHub:
    """The server, started on construction on 127.0.0.1 (ephemeral port), in a thread."""

    def __init__(self, host: str = "127.0.0.1"):
        self._repos: dict[str, Repo] = {}
        self._cuts: dict[tuple[str, str], list[int]] = {}  # (repo, path) -> [after, times]
        self._lock = threading.Lock()
        self.log: list[LoggedRequest] = []
        self.tree_page_size = 1000  # the Hub's page size for a tree listing without expand
        self._server = _Server((host, 0), _Handler)
        self._server.hub = self
        self.endpoint = f"http://{host}:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="fake-hub", daemon=True)
        self._thread.start()

    def add_repo(self, repo_id: str, path: str | pathlib.Path, *, branch: str = "main",
                 token: str | None = None, private: bool = False) -> str:
        """Point `branch` of `repo_id` at a new commit holding the files under `path`
        (read now). With `token`, downloads need `Authorization: Bearer <token>`: a gated
        repo (info and listing stay public), or with private=True a repo that is not found
        without it. Returns the commit sha; older commits stay reachable by sha."""
        files = read_dir(pathlib.Path(path))
        sha = commit_sha(repo_id, files)
        with self._lock:
            repo = self._repos.setdefault(repo_id, Repo(repo_id))
            if token is not None:
                repo.token, repo.private = token, private
            repo.commits[sha] = files
            repo.branches[branch] = sha
        return sha

    def commit(self, repo_id: str, branch: str = "main") -> str:
        return self._repos[repo_id].branches[branch]

    def repo(self, repo_id: str) -> Repo | None:
        with self._lock:
            return self._repos.get(repo_id)

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request so far, in arrival order."""
        with self._lock:
            return [(r.method, r.path) for r in self.log]

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    def cut(self, repo_id: str, filename: str, after_bytes: int, times: int) -> None:
        """The next `times` GETs of the file send a full Content-Length header, then only
        `after_bytes` of the body, then close the connection."""
        with self._lock:
            self._cuts[(repo_id, filename)] = [after_bytes, times]

    def cut_once(self, repo_id: str, filename: str, after_bytes: int) -> None:
        self.cut(repo_id, filename, after_bytes, times=1)

    def take_cut(self, repo_id: str, filename: str) -> int | None:
        with self._lock:
            cut = self._cuts.get((repo_id, filename))
            if cut is None:
                return None
            cut[1] -= 1
            if cut[1] <= 0:
                del self._cuts[(repo_id, filename)]
            return cut[0]

    def record(self, request: LoggedRequest) -> None:
        with self._lock:
            self.log.append(request)

    def stop(self) -> None:
        """Stop serving and drop open keep-alive connections (the client's pool sees them
        closed); idempotent."""
        if not self._thread.is_alive():
            return
        self._server.shutdown()
        self._server.server_close()
        with self._server.lock:
            connections = list(self._server.connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: FakeHub

    def __init__(self, *args: object):
        super().__init__(*args)
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hanging up is fine
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's pooled connections expect
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.lock:
            self.server.connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # the hub's own log is hub.log

    def do_GET(self) -> None:
        self._dispatch(send_body=True)

    def do_HEAD(self) -> None:
        self._dispatch(send_body=False)

    def _dispatch(self, send_body: bool) -> None:
        url = urlsplit(self.path)
        # Split before decoding: a revision comes quoted whole ("refs%2Fpr%2F1").
        segments = [unquote(s) for s in url.path.split("/")[1:]]
        self._status = 0
        try:
            if segments == ["api", "agent-harnesses"]:
                self._send_json(_NO_AGENTS, send_body)
            elif segments[:2] == ["api", "models"] and self.command == "GET":
                self._api(segments[2:], parse_qs(url.query))
            elif "resolve" in segments[1:]:
                self._resolve(segments, send_body)
            else:
                raise HubError(404, None, "Sorry, we can't find the page you are looking for.")
        except HubError as e:
            self._send_error(e, send_body)
        finally:
            self.server.hub.record(LoggedRequest(
                self.command, "/" + "/".join(segments), url.query,
                {k.lower(): v for k, v in self.headers.items()}, self._status))

    # --- access ------------------------------------------------------------------------

    def _bearer(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    def _repo(self, repo_id: str) -> Repo:
        """The repo, or the Hub's answer for a missing (or hidden private) one: 401 to an
        anonymous client, 404 to an authenticated one, both with RepoNotFound."""
        repo = self.server.hub.repo(repo_id)
        token = self._bearer()
        if repo is None or (repo.private and token != repo.token):
            raise HubError(404 if token else 401, "RepoNotFound", "Repository not found")
        return repo

    def _check_download(self, repo: Repo) -> None:
        token = self._bearer()
        if repo.token is None or token == repo.token:
            return
        if token is None:
            raise HubError(401, "GatedRepo",
                           f"Access to model {repo.repo_id} is restricted. You must have access "
                           "to it and be authenticated to access it. Please log in.")
        raise HubError(403, "GatedRepo",
                       f"Access to model {repo.repo_id} is restricted and you are not in the "
                       f"authorized list. Visit {self.server.hub.endpoint}/{repo.repo_id} to "
                       "ask for access.")

    def _split_repo(self, segments: list[str]) -> tuple[str, list[str]]:
        """(repo id, the segments after it): "org/name", or a legacy id without org."""
        two = "/".join(segments[:2])
        if len(segments) >= 2 and (self.server.hub.repo(two) is not None
                                   or segments[1] not in ("revision", "tree")):
            return two, segments[2:]
        return segments[0] if segments else "", segments[1:]

    # --- routes ------------------------------------------------------------------------

    def _api(self, segments: list[str], query: dict[str, list[str]]) -> None:
        repo_id, rest = self._split_repo(segments)
        repo = self._repo(repo_id)
        if not rest:
            self._send_json(self._info(repo, "main"), True)
        elif rest[0] == "revision" and len(rest) == 2:
            self._send_json(self._info(repo, rest[1]), True)
        elif rest[0] == "tree" and len(rest) >= 2:
            self._tree(repo, rest[1], "/".join(rest[2:]).strip("/"), query)
        else:
            raise HubError(404, None, "Sorry, we can't find the page you are looking for.")

    def _info(self, repo: Repo, revision: str) -> dict:
        sha = repo.resolve(revision)
        files = repo.commits[sha]
        stamp = "2024-01-01T00:00:00.000Z"
        return {"_id": sha[:24], "id": repo.repo_id, "modelId": repo.repo_id, "sha": sha,
                "lastModified": stamp, "createdAt": stamp, "private": repo.private,
                "gated": "manual" if repo.token and not repo.private else False,
                "disabled": False, "downloads": 0, "likes": 0, "tags": [], "spaces": [],
                "siblings": [{"rfilename": path} for path in files],
                "usedStorage": sum(len(f.data) for f in files.values())}

    def _tree(self, repo: Repo, revision: str, prefix: str,
              query: dict[str, list[str]]) -> None:
        """One page of the listing under `prefix`, files and directories, with the next
        page's URL in a `Link: <...>; rel="next"` header as the Hub paginates."""
        sha = repo.resolve(revision)
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        entries = listing(repo.commits[sha], prefix, recursive)
        if entries is None:
            raise HubError(404, "EntryNotFound", f"{prefix} does not exist on \"{revision}\"")
        start = int(query.get("cursor", ["0"])[0])
        size = self.server.hub.tree_page_size
        page, headers = entries[start:start + size], {}
        if start + size < len(entries):
            params = {k: v[0] for k, v in query.items() if k != "cursor"}
            params["cursor"] = str(start + size)
            path = "/" + quote(prefix, safe="") if prefix else ""
            headers["Link"] = (f"<{self.server.hub.endpoint}/api/models/{repo.repo_id}/tree/"
                               f"{quote(revision, safe='')}{path}?{urlencode(params)}>; "
                               'rel="next"')
        self._send_json(page, True, headers=headers)

    def _resolve(self, segments: list[str], send_body: bool) -> None:
        at = segments.index("resolve", 1)
        repo = self._repo("/".join(segments[:at]))
        self._check_download(repo)
        if len(segments) < at + 3:
            raise HubError(404, None, "Sorry, we can't find the page you are looking for.")
        sha = repo.resolve(segments[at + 1])
        path = "/".join(segments[at + 2:])
        f = repo.commits[sha].get(path)
        if f is None:
            raise HubError(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": sha})
        self._send_file(repo, sha, f, send_body)

    def _send_file(self, repo: Repo, sha: str, f: RepoFile, send_body: bool) -> None:
        size = len(f.data)
        name = f.path.rsplit("/", 1)[-1]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": mimetypes.guess_type(name)[0] or "application/octet-stream",
                   "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}; "
                                          f'filename="{name}";'}
        if f.sha256 is not None:
            headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(size)})
        start, end = byte_range(self.headers.get("Range"), size)
        status = 200
        if start is not None:
            if start >= size or end < start:
                raise HubError(416, None, "Requested Range Not Satisfiable",
                               {"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        body = f.data[start or 0:end + 1]
        cut = self.server.hub.take_cut(repo.repo_id, f.path) if send_body else None
        self._start(status, headers, len(body))
        if cut is not None:  # the header promised len(body) bytes: send some, then hang up
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
        elif send_body:
            self.wfile.write(body)

    # --- writing -----------------------------------------------------------------------

    def _start(self, status: int, headers: dict[str, str], length: int) -> None:
        """The status line and headers of a body of `length` bytes (a HEAD answer gets the
        same headers and no body)."""
        self._status = status
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send_json(self, payload: object, send_body: bool, status: int = 200,
                   headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self._start(status, {"Content-Type": "application/json; charset=utf-8",
                             **(headers or {})}, len(body))
        if send_body:
            self.wfile.write(body)

    def _send_error(self, error: HubError, send_body: bool) -> None:
        headers = {"X-Error-Message": error.message, **error.headers}
        if error.code is not None:
            headers["X-Error-Code"] = error.code
        self._send_json({"error": error.message}, send_body, error.status, headers)
