"""A local Hugging Face hub-compatible HTTP server for tests, with switchable faults.

Serves the routes real `huggingface_hub` 1.x code uses (see field notes, "Hugging Face hub client"):
`HEAD/GET /{repo}/resolve/{rev}/{path}`, `/api/models` (search), `/api/models/{repo}/revision/{rev}`,
`/api/models/{repo}/tree/{rev}`, plus `/cdn/{sha256}` when `redirect_to_cdn` sends LFS bodies to another host
(`localhost` instead of `127.0.0.1`, as the hub redirects to its CDN). Runs in a thread
(stdlib `ThreadingHTTPServer`); every fault is real network behaviour: a dropped connection, a stalled body,
a server that ignores Range, corrupted bytes, error statuses, throttled bodies.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Faults:
    """Switch per test; applies to file bodies (`resolve` GET and `/cdn`) of whole-file and resumed downloads
    (no Range, or `bytes=N-`), not to closed ranges (`bytes=N-M`: a client reading a file's header or a README),
    which have their own (`range_*`), nor to the API (`api_*`). `HubServer.faults_for[suffix]` gives the files
    whose path ends so their own faults."""

    drop_after: int | None = None  # close the connection after this many body bytes ...
    drop_times: int = 1  # ... for this many requests
    stall_after: int | None = None  # stop sending after this many body bytes ...
    stall_s: float = 5.0  # ... for this long, then close
    stall_times: int = 1
    hold_after: int | None = None  # after this many body bytes, set `held` and wait for `release` (a point
    hold_times: int = 1  # ... the test can act at, whatever the machine's speed), for this many requests
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    ignore_range: bool = False  # answer 200 with the whole file to Range requests
    corrupt: bool = False  # flip bytes in the body (headers still carry the true sha256) ...
    corrupt_times: int | None = None  # ... for this many requests (None: every one)
    status: int | None = None  # answer every resolve/tree/revision request with this status ...
    error_code: str | None = None  # ... and this X-Error-Code
    throttle_bps: int | None = None  # send bodies at about this rate
    malformed_json: bool = False  # /api answers are not JSON
    absurd_size: bool = False  # sizes of 10**18 bytes in tree answers and X-Linked-Size
    search_garbage: bool = False  # search results with broken entries among good ones
    range_drop_after: int | None = None  # a closed-range read closes the connection after this many body bytes ...
    range_drop_times: int = 1  # ... for this many requests
    api_drop_times: int = 0  # this many `/api/` requests (tree, revision, search) are closed before an answer


@dataclass
class Repo:
    files: dict[str, bytes] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    downloads: int = 0
    likes: int = 0
    gated: bool = False  # needs `Authorization: Bearer <one of HubServer.accepted_tokens>`


@dataclass
class RequestLog:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    authorization: str | None


class HubServer:
    """`with HubServer() as hub:` → `hub.url`; add repos with `add_file`; switch `hub.faults`; read `hub.log`."""

    def __init__(self, *, redirect_to_cdn: bool = False) -> None:
        self.repos: dict[str, Repo] = {}
        self.faults = Faults()
        self.faults_for: dict[str, Faults] = {}  # path suffix → faults of those files (else `faults`)
        self.redirect_to_cdn = redirect_to_cdn
        self.accepted_tokens: set[str] = set()
        self.log: list[RequestLog] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_file(self, repo: str, path: str, data: bytes, **repo_fields: Any) -> str:
        """Adds (or replaces) a file; returns its sha256."""
        entry = self.repos.setdefault(repo, Repo())
        for key, value in repo_fields.items():
            setattr(entry, key, value)
        entry.files[path] = data
        return hashlib.sha256(data).hexdigest()

    def body_bytes(self, path_suffix: str = "") -> int:
        """Body bytes sent for GETs whose URL ends with `path_suffix`."""
        with self._lock:
            return sum(r.body_bytes for r in self.log if r.method == "GET" and r.path.endswith(path_suffix))

    def gets(self, path_suffix: str = "") -> list[RequestLog]:
        with self._lock:
            return [r for r in self.log if r.method == "GET" and r.path.endswith(path_suffix)]

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # --- used by the handler -----------------------------------------------------------------------------

    def _record(self, entry: RequestLog) -> None:
        with self._lock:
            self.log.append(entry)

    def _take(self, faults: Faults, name: str) -> bool:
        """Consumes one use of a counted fault (`drop`, `stall`, `corrupt`, `hold`, `range_drop`, `api_drop`)."""
        with self._lock:
            times = getattr(faults, f"{name}_times")
            if times <= 0:
                return False
            setattr(faults, f"{name}_times", times - 1)
            return True

    def _find_blob(self, sha: str) -> bytes | None:
        for repo in self.repos.values():
            for data in repo.files.values():
                if hashlib.sha256(data).hexdigest() == sha:
                    return data
        return None


def _is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(".gguf") or len(data) > 1024


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _make_handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        # --- plumbing --------------------------------------------------------------------------------
        def _send(self, status: int, headers: dict[str, str], body: bytes = b"", *, head: bool = False) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            # logged before the client can have the answer: a test reading `hub.log` after its call returned
            # must find it there, whatever the threads' timing
            self._log(status, 0 if head else len(body))
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

        def _log(self, status: int, body_bytes: int) -> RequestLog:
            entry = RequestLog(
                self.command,
                urlsplit(self.path).path,
                self.headers.get("Range"),
                status,
                body_bytes,
                self.headers.get("Authorization"),
            )
            hub._record(entry)
            return entry

        def _json(self, data: Any) -> None:
            if hub.faults.malformed_json:
                self._send(200, {"Content-Type": "application/json"}, b'{"id": "oops", [truncated')
                return
            self._send(200, {"Content-Type": "application/json"}, json.dumps(data).encode())

        def _error(self, status: int, code: str | None, head: bool = False) -> None:
            headers = {"Content-Type": "application/json"}
            if code:
                headers["X-Error-Code"] = code
            body = json.dumps({"error": code or "error"}).encode()
            self._send(status, headers, body, head=head)

        def _repo(self, name: str, head: bool = False) -> Repo | None:
            if hub.faults.status is not None:
                self._error(hub.faults.status, hub.faults.error_code, head)
                return None
            repo = hub.repos.get(name)
            if repo is None:
                self._error(401, "RepoNotFound", head)  # like the hub: 401 for unknown or private
                return None
            if repo.gated:
                auth = self.headers.get("Authorization", "")
                token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
                if token is None:
                    self._error(401, "GatedRepo", head)
                    return None
                if token not in hub.accepted_tokens:
                    self._error(403, "GatedRepo", head)
                    return None
            return repo

        # --- routes ----------------------------------------------------------------------------------
        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        def _route(self, head: bool) -> None:
            try:
                split = urlsplit(self.path)
                path = split.path
                query = parse_qs(split.query)
                if path.startswith("/api/") and hub._take(hub.faults, "api_drop"):
                    self._log(0, 0)  # a hub that drops the connection: no status line, no body
                    self.close_connection = True
                    return
                if path == "/api/models":
                    self._search(query)
                    return
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path)
                if m:
                    self._revision(unquote(m.group(1)), unquote(m.group(2)))
                    return
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
                if m:
                    self._tree(unquote(m.group(1)), unquote(m.group(2)))
                    return
                m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
                if m:
                    data = hub._find_blob(m.group(1))
                    if data is None:
                        self._error(404, None, head)
                    else:
                        self._file(data, m.group(1), {}, head)
                    return
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:
                    self._resolve(unquote(m.group(1)), unquote(m.group(2)), unquote(m.group(3)), head)
                    return
                self._error(404, None, head)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _search(self, query: dict[str, list[str]]) -> None:
            words = [w.lower() for w in query.get("search", [])]
            filters = query.get("filter", [])
            limit = int(query.get("limit", ["1000"])[0])
            results: list[dict[str, Any]] = []
            for name, repo in sorted(hub.repos.items(), key=lambda kv: -kv[1].downloads):
                if any(w not in name.lower() for w in words):
                    continue
                if any(f not in repo.tags for f in filters):
                    continue
                results.append(
                    {
                        "id": name,
                        "_id": name,
                        "downloads": repo.downloads,
                        "likes": repo.likes,
                        "tags": repo.tags,
                        "sha": COMMIT,
                        "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                    }
                )
            if hub.faults.search_garbage:
                results = [
                    {"id": "../../etc/passwd", "downloads": 1},
                    {"id": "bad/types", "downloads": "many", "likes": None, "tags": "x", "siblings": []},
                    *results,
                ]
            self._json(results[:limit])

        def _revision(self, name: str, rev: str) -> None:
            repo = self._repo(name)
            if repo is None:
                return
            if rev not in ("main", COMMIT):
                self._error(404, "RevisionNotFound")
                return
            self._json({"id": name, "sha": COMMIT, "siblings": [{"rfilename": p} for p in sorted(repo.files)]})

        def _tree(self, name: str, rev: str) -> None:
            repo = self._repo(name)
            if repo is None:
                return
            if rev not in ("main", COMMIT):
                self._error(404, "RevisionNotFound")
                return
            items: list[dict[str, Any]] = []
            folders = sorted({p.rsplit("/", 1)[0] for p in repo.files if "/" in p})
            items.extend({"type": "directory", "path": f, "oid": _git_oid(f.encode())} for f in folders)
            for path, data in sorted(repo.files.items()):
                size = 10**18 if hub.faults.absurd_size else len(data)
                item: dict[str, Any] = {"type": "file", "path": path, "size": size, "oid": _git_oid(data)}
                if _is_lfs(path, data):
                    item["size"] = 134
                    item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
                items.append(item)
            self._json(items)

        def _resolve(self, name: str, rev: str, path: str, head: bool) -> None:
            repo = self._repo(name, head)
            if repo is None:
                return
            if rev not in ("main", COMMIT):
                self._error(404, "RevisionNotFound", head)
                return
            data = repo.files.get(path)
            if data is None:
                self._error(404, "EntryNotFound", head)
                return
            sha = hashlib.sha256(data).hexdigest()
            lfs = _is_lfs(path, data)
            size = str(10**18) if hub.faults.absurd_size else str(len(data))
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha if lfs else _git_oid(data)}"'}
            if lfs:
                headers["X-Linked-Etag"] = f'"{sha}"'
                headers["X-Linked-Size"] = size
            if lfs and hub.redirect_to_cdn:
                headers["Location"] = f"http://localhost:{hub.port}/cdn/{sha}"
                self._send(302, headers, b"", head=head)
                return
            self._file(data, sha, headers, head, path)

        def _file(self, data: bytes, sha: str, headers: dict[str, str], head: bool, path: str = "") -> None:
            faults = next((f for suffix, f in hub.faults_for.items() if path.endswith(suffix)), hub.faults)
            range_text = (self.headers.get("Range") or "").strip()
            if re.fullmatch(r"bytes=\d+-\d+", range_text):  # a header read: only its own faults
                closed = faults
                faults = Faults()
                if closed.range_drop_after is not None and hub._take(closed, "range_drop"):
                    faults.drop_after, faults.drop_times = closed.range_drop_after, 1
            total = len(data)
            start, end = 0, total - 1
            status = 200
            range_header = self.headers.get("Range")
            if range_header and not faults.ignore_range:
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
                if m:
                    start = int(m.group(1))
                    end = min(int(m.group(2)), total - 1) if m.group(2) else total - 1
                    if start >= total:
                        self._send(416, {"Content-Range": f"bytes */{total}"}, b"", head=head)
                        return
                    status = 206
            body = data[start : end + 1]
            if faults.corrupt and body and (faults.corrupt_times is None or hub._take(faults, "corrupt")):
                middle = len(body) // 2
                body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{total}")
            entry = self._log(status, 0)  # counting each piece before it goes out (see `_send`)
            self.end_headers()
            if head:
                return
            limit = len(body)
            cut = False
            stall = False
            if faults.drop_after is not None and faults.drop_after < limit and hub._take(faults, "drop"):
                limit, cut = faults.drop_after, True
            elif faults.stall_after is not None and faults.stall_after < limit and hub._take(faults, "stall"):
                limit, stall = faults.stall_after, True
            hold = faults.hold_after if faults.hold_after is not None and hub._take(faults, "hold") else None
            sent = 0
            chunk = 16 * 1024
            began = time.monotonic()
            try:
                while sent < limit and not hub._stop.is_set():
                    end = min(limit, sent + chunk)
                    if hold is not None and sent < hold:
                        end = min(end, hold)
                    piece = body[sent:end]
                    entry.body_bytes = sent + len(piece)
                    self.wfile.write(piece)
                    sent += len(piece)
                    if hold is not None and sent == hold:
                        self.wfile.flush()
                        faults.held.set()
                        while not faults.release.wait(0.05) and not hub._stop.is_set():
                            pass
                    if faults.throttle_bps:
                        ahead = sent / faults.throttle_bps - (time.monotonic() - began)
                        if ahead > 0:
                            hub._stop.wait(ahead)
                if stall:
                    self.wfile.flush()
                    hub._stop.wait(faults.stall_s)
            except (BrokenPipeError, ConnectionResetError):
                entry.body_bytes = sent
                cut = True
            if cut or stall or sent < len(body):
                self.close_connection = True

    return Handler
