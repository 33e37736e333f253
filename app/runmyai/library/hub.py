"""Qt-free, async Hugging Face hub client: search, file listings with sizes and sha256, file metadata, a file's
first bytes (a GGUF's header), a README.

Every blocking `huggingface_hub` call runs in the client's own thread pool under a deadline, so the event loop
(qasync on the Qt loop) never waits on the network. Every read is retried with backoff when it failed in a way a
later try may not (a dropped connection, a timeout, 5xx, 429): a hub that drops connections must not stop a
model's planning halfway (a range read continues from the bytes it already has). Everything the hub sends is
untrusted: responses are validated here and every failure becomes a `HubError` whose text is one human sentence.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import json
import logging
import os
import random
import re
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal, TypeVar

import httpx
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url, set_client_factory
from huggingface_hub import errors as hf_errors
from huggingface_hub.utils._headers import build_hf_headers
from huggingface_hub.utils._http import default_client_factory

REPACKED_TAG = "tokenwing"  # the tag our repacked uploads carry
REPACKED_SUFFIX = ".tw.gguf"
GGUF_SUFFIX = ".gguf"
MAX_FILE_SIZE = 1 << 50  # 1 PiB: anything larger (or negative) is a broken or hostile response
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_TRUTHY = {"1", "true", "yes", "on", "y", "t"}

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRIES = 4  # tries after the first, for every read (a download's file body has its own, in downloads.py)
RETRY_BACKOFF_S = 0.5  # the first wait; doubled each fruitless try (±20 %), at most MAX_BACKOFF_S
MAX_BACKOFF_S = 30.0
README_MAX_BYTES = 512 * 1024  # a model card longer than this is cut (and its last character dropped if split)
HubErrorKind = Literal[
    "offline", "network", "gated", "auth", "not_found", "malformed", "server", "corrupt", "no_space", "changed", "other"
]


@dataclass(frozen=True)
class HubFile:
    repo: str
    path: str
    revision: str
    size: int | None
    sha256: str | None  # lowercase hex, only for LFS files (the hub publishes no sha256 for small git files)


@dataclass(frozen=True)
class HubModel:
    repo: str
    downloads: int
    likes: int
    tags: tuple[str, ...]
    files: tuple[HubFile, ...]  # may be empty from search; sizes and sha256 come from `list_files`


class HubError(Exception):
    """A hub failure; `str(e)` is one human sentence. `kind` lets callers react without parsing text."""

    def __init__(
        self,
        message: str,
        kind: HubErrorKind = "other",
        *,
        retryable: bool = False,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable  # a later try may succeed (network trouble, 5xx, 429)
        self.retry_after_s = retry_after_s  # how long the hub asked us to wait (429/503 Retry-After)
        self.missing_file = False  # the repository is there, the file is not (404 / EntryNotFound)


HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)  # huggingface_hub's own session has none: a silent hub hangs
_session_lock = threading.Lock()
_session_configured = False


def _client_with_timeouts() -> httpx.Client:
    client = default_client_factory()
    client.timeout = HTTP_TIMEOUT
    return client


def _configure_hf_session() -> None:
    """Gives huggingface_hub's shared (process-wide) httpx session connect/read timeouts, once."""
    global _session_configured
    with _session_lock:
        if not _session_configured:
            set_client_factory(_client_with_timeouts)
            _session_configured = True


def env_offline() -> bool:
    """`HF_HUB_OFFLINE` as set now (huggingface_hub itself only reads it at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY or bool(constants.HF_HUB_OFFLINE)


def normalize_sha256(value: object) -> str | None:
    """A sha256 from an ETag/oid (quoted, maybe weak) in lowercase hex, or None when it is not a sha256."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.startswith("W/"):
        text = text[2:]
    text = text.strip('"').lower()
    return text if _SHA256.match(text) else None


def checked_size(value: object, what: str) -> int | None:
    """A size from the hub: None when absent, a `HubError` when it is not a sane byte count."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise HubError(f"The hub sent an invalid size for {what}.", "malformed")
    try:
        size = int(value)
    except ValueError:
        raise HubError(f"The hub sent an invalid size for {what}.", "malformed") from None
    if size < 0 or size > MAX_FILE_SIZE:
        raise HubError(f"The hub sent an impossible size ({size} bytes) for {what}.", "malformed")
    return size


def _as_int(value: object) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(0, value)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return 0


def _check_repo(repo: str) -> None:
    if not isinstance(repo, str) or not _REPO_ID.match(repo) or ".." in repo or len(repo) > 200:
        raise HubError(f"“{repo}” is not a valid repository name (expected owner/name).", "not_found")


def _check_path(path: str) -> None:
    parts = path.split("/") if isinstance(path, str) else []
    if not path or path.startswith("/") or "\\" in path or "\0" in path or any(p in ("", ".", "..") for p in parts):
        raise HubError(f"“{path}” is not a valid file path in a repository.", "not_found")


def _gated(what: str) -> HubError:
    return HubError(
        f"{what} is in a gated repository: accept its terms on the model's hub page, "
        "then sign in with an access token (HF_TOKEN).",
        "gated",
    )


def _repo_not_found(what: str) -> HubError:
    return HubError(
        f"{what} was not found on the hub (it does not exist, or it is private and you are not signed in).",
        "not_found",
    )


def _missing_file(what: str) -> HubError:
    error = HubError(f"{what} does not exist in that repository.", "not_found")
    error.missing_file = True
    return error


def error_from_exception(exc: BaseException, *, what: str, endpoint: str) -> HubError:
    """One human sentence for anything huggingface_hub or httpx can raise while talking to the hub."""
    if isinstance(exc, HubError):
        return exc
    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return HubError(f"Offline mode is on, so {what} can't be fetched from the hub.", "offline")
    if isinstance(exc, hf_errors.GatedRepoError):
        return _gated(what)
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return HubError(f"The requested revision of {what} does not exist on the hub.", "not_found")
    if isinstance(exc, hf_errors.RemoteEntryNotFoundError | hf_errors.EntryNotFoundError):
        return _missing_file(what)
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return _repo_not_found(what)
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        error = error_from_status(status, what=what, error_code=None)
        if exc.response is not None:
            error.retry_after_s = retry_after(exc.response.headers.get("Retry-After"))
        return error
    if isinstance(exc, httpx.TimeoutException | asyncio.TimeoutError | TimeoutError):
        return HubError(f"The hub at {endpoint} did not answer in time for {what}.", "network", retryable=True)
    if isinstance(exc, httpx.TransportError | OSError):
        return HubError(f"Could not reach the hub at {endpoint} for {what}.", "network", retryable=True)
    if isinstance(exc, json.JSONDecodeError | ValueError | KeyError | TypeError | AttributeError | IndexError):
        return HubError(f"The hub sent a malformed answer for {what}.", "malformed")
    return HubError(f"Unexpected problem with the hub for {what} ({type(exc).__name__}).", "other")


def error_from_status(status: int | None, *, what: str, error_code: str | None) -> HubError:
    """An HTTP error status (and the hub's `X-Error-Code`) as a `HubError`."""
    if error_code == "GatedRepo":
        return _gated(what)
    if error_code == "RepoNotFound":
        return _repo_not_found(what)
    if error_code == "RevisionNotFound":
        return HubError(f"The requested revision of {what} does not exist on the hub.", "not_found")
    if error_code == "EntryNotFound" or status == 404:
        return _missing_file(what)
    if status == 401:
        return HubError(f"The hub refused access to {what}: sign in with a valid access token (HF_TOKEN).", "auth")
    if status == 403:
        return HubError(f"Your access token is not allowed to read {what}.", "auth")
    if status == 416:
        return HubError(f"The server rejected the resume position for {what}.", "server", retryable=True)
    if status == 429:
        return HubError(f"The hub is rate-limiting downloads of {what}; retrying later.", "server", retryable=True)
    if status is not None and status >= 500:
        return HubError(f"The hub had a server error ({status}) for {what}.", "server", retryable=True)
    return HubError(f"The hub answered HTTP {status} for {what}.", "server")


def retry_after(value: str | None) -> float | None:
    """A `Retry-After` in seconds (≤ 60), None when absent or a date."""
    if value and value.strip().isdigit():
        return min(float(value.strip()), 60.0)
    return None


class HubClient:
    """Async facade over `huggingface_hub.HfApi` for the app. Safe to call from the event loop thread.

    `retries`: tries after the first for a read that failed retryably (`HubError.retryable`), waiting
    `retry_backoff_s` × 2^(n−1) (±20 %, ≤ 30 s, or the hub's Retry-After) between them; the count starts again
    whenever a try brought bytes (a range read continues where the dropped one stopped)."""

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | None = None,
        offline: bool = False,
        *,
        request_timeout_s: float = 30.0,
        retries: int = RETRIES,
        retry_backoff_s: float = RETRY_BACKOFF_S,
    ) -> None:
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.token = token or os.environ.get("HF_TOKEN") or None
        self._offline = offline
        self._headers: dict[str, str] | None = None
        self.request_timeout_s = request_timeout_s
        self.retries = max(0, retries)
        self.retry_backoff_s = retry_backoff_s
        self._api = HfApi(endpoint=self.endpoint, token=self._hf_token(), library_name="runmyai")
        # our own daemon-less pool, not the loop's default executor: a request stuck in a thread (bounded by
        # HTTP_TIMEOUT) must not hold up `loop.shutdown_default_executor()` when the app quits
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="runmyai-hub")
        _configure_hf_session()

    @property
    def offline(self) -> bool:
        """True when the app's flag or `HF_HUB_OFFLINE` says not to touch the network."""
        return self._offline or env_offline()

    def set_offline(self, offline: bool) -> None:
        self._offline = offline

    def _hf_token(self) -> str | bool:
        # False: never fall back to a token file on disk the user didn't choose for this app
        return self.token if self.token else False

    def url(self, repo: str, path: str, revision: str = "main") -> str:
        """The download URL (`hf_hub_url`); it may redirect to a CDN."""
        _check_repo(repo)
        _check_path(path)
        return hf_hub_url(repo, path, revision=revision, endpoint=self.endpoint)

    def headers(self) -> dict[str, str]:
        """Headers for our own downloads: user agent and, when set, the token (the first call takes ~40 ms,
        probing installed libraries for the user agent: from the event loop, use `download_headers`)."""
        if self._headers is None:
            headers: dict[str, str] = build_hf_headers(token=self._hf_token(), library_name="runmyai")
            headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets in the file
            self._headers = headers
        return dict(self._headers)

    async def download_headers(self) -> dict[str, str]:
        if self._headers is None:
            await asyncio.to_thread(self.headers)
        return self.headers()

    def _require_online(self, what: str) -> None:
        if self.offline:
            raise HubError(
                f"Offline mode is on (HF_HUB_OFFLINE or the app's setting), so {what} can't be fetched; "
                "only models already on disk are available.",
                "offline",
            )

    async def _call(self, fn: Callable[[], T], what: str, retries: int | None = None) -> T:
        """`fn` (a blocking huggingface_hub call) in the pool under the deadline, retried (see the class)."""
        self._require_online(what)

        async def once() -> T:
            try:
                future = asyncio.get_running_loop().run_in_executor(self._pool, fn)
                return await asyncio.wait_for(future, self.request_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise error_from_exception(exc, what=what, endpoint=self.endpoint) from None

        return await self._retrying(once, retries)

    async def _retrying(
        self, once: Callable[[], Awaitable[T]], retries: int | None = None, progress: Callable[[], int] | None = None
    ) -> T:
        """`once()` until it succeeds, fails for good, or has failed `retries` times in a row without `progress()`
        (bytes kept from a try) growing; the last error then says how many tries it took."""
        limit = self.retries if retries is None else max(0, retries)
        failures = tries = 0
        while True:
            before = progress() if progress is not None else 0
            tries += 1
            try:
                return await once()
            except HubError as exc:
                if not exc.retryable:
                    raise
                moved = progress is not None and progress() > before
                failures = 0 if moved else failures + 1
                if failures > limit:
                    if tries > 1:
                        raise HubError(
                            f"{str(exc).rstrip('.')} ({tries} tries).",
                            exc.kind,
                            retryable=True,
                            retry_after_s=exc.retry_after_s,
                        ) from None
                    raise
                delay = exc.retry_after_s
                if delay is None:
                    delay = min(self.retry_backoff_s * 2 ** max(0, failures - 1), MAX_BACKOFF_S)
                    delay *= random.uniform(0.8, 1.2)
                log.info("%s Retrying in %.1f s (try %d).", exc, delay, tries + 1)
                await asyncio.sleep(delay)

    async def search(
        self, query: str, kind: Literal["repacked", "gguf"] = "repacked", limit: int = 50
    ) -> list[HubModel]:
        """Models matching `query`: repacked TokenWing models (tag `tokenwing`) or any GGUF repository."""
        if kind not in ("repacked", "gguf"):
            raise HubError(f"Unknown kind of search “{kind}”.", "other")
        limit = max(1, min(int(limit), 1000))
        tag = REPACKED_TAG if kind == "repacked" else "gguf"
        suffix = REPACKED_SUFFIX if kind == "repacked" else GGUF_SUFFIX
        search = query.strip() or None

        def run() -> list[Any]:
            found = self._api.list_models(
                search=search,
                filter=tag,
                sort="downloads",
                limit=limit,
                expand=["downloads", "likes", "tags", "siblings"],
            )
            return list(islice(found, limit))

        infos = await self._call(run, f"the search for “{query}”")
        models: list[HubModel] = []
        for info in infos:
            try:
                models.append(self._model_from_info(info, suffix))
            except HubError:
                continue  # one broken entry must not hide the rest
        return models

    def _model_from_info(self, info: Any, suffix: str) -> HubModel:
        repo = getattr(info, "id", None)
        if not isinstance(repo, str) or not _REPO_ID.match(repo):
            raise HubError("The hub sent a search result without a valid name.", "malformed")
        raw_tags = getattr(info, "tags", None)
        tags = tuple(t for t in raw_tags if isinstance(t, str)) if isinstance(raw_tags, list) else ()
        files: list[HubFile] = []
        siblings = getattr(info, "siblings", None)
        revision = getattr(info, "sha", None)
        revision = revision if isinstance(revision, str) and revision else "main"
        for sibling in siblings if isinstance(siblings, list) else []:
            name = getattr(sibling, "rfilename", None)
            if not isinstance(name, str) or not name.endswith(suffix):
                continue
            lfs = getattr(sibling, "lfs", None)
            sha = normalize_sha256(getattr(lfs, "sha256", None)) if lfs is not None else None
            try:
                size = checked_size(getattr(sibling, "size", None), name)
            except HubError:
                size = None
            files.append(HubFile(repo, name, revision, size, sha))
        return HubModel(
            repo=repo,
            downloads=_as_int(getattr(info, "downloads", 0)),
            likes=_as_int(getattr(info, "likes", 0)),
            tags=tags,
            files=tuple(files),
        )

    async def list_files(self, repo: str, revision: str = "main") -> list[HubFile]:
        """Every file in the repository (recursively) with its size and, for LFS files, its sha256."""
        _check_repo(repo)

        def run() -> list[Any]:
            return list(self._api.list_repo_tree(repo, recursive=True, revision=revision))

        entries = await self._call(run, repo)
        files: list[HubFile] = []
        for entry in entries:
            path = getattr(entry, "path", None)
            if not isinstance(path, str) or not hasattr(entry, "blob_id"):
                continue  # folders
            try:
                _check_path(path)
            except HubError:
                raise HubError(f"The hub sent an invalid file name in {repo}.", "malformed") from None
            size = checked_size(getattr(entry, "size", None), path)
            lfs = getattr(entry, "lfs", None)
            sha: str | None = None
            if lfs is not None:
                raw_sha = getattr(lfs, "sha256", None)
                sha = normalize_sha256(raw_sha)
                if sha is None:
                    raise HubError(f"The hub sent an invalid sha256 for {path}.", "malformed")
                lfs_size = checked_size(getattr(lfs, "size", None), path)
                size = lfs_size if lfs_size is not None else size
            files.append(HubFile(repo, path, revision, size, sha))
        return files

    async def file_info(self, repo: str, path: str, revision: str = "main", *, retries: int | None = None) -> HubFile:
        """Size and sha256 of one file from the hub's HEAD answer (`X-Linked-Size`, `X-Linked-Etag`). `retries`:
        instead of the client's (the download manager retries with its own, shown on the download's row)."""
        url = self.url(repo, path, revision)
        token = self._hf_token()

        def run() -> Any:
            return get_hf_file_metadata(url, token=token, endpoint=self.endpoint, library_name="runmyai")

        meta = await self._call(run, f"“{path}” ({repo})", retries)
        size = checked_size(getattr(meta, "size", None), path)
        return HubFile(repo, path, revision, size, normalize_sha256(getattr(meta, "etag", None)))

    async def read_prefix(self, repo: str, path: str, length: int, revision: str = "main") -> bytes:
        """The first `length` bytes of a file (fewer when it is shorter), with HTTP range requests: a GGUF's
        header without its tensor data. A dropped connection is retried from the bytes already read; a server
        that ignores Range is read only that far, then closed."""
        url = self.url(repo, path, revision)
        what = f"the start of “{path}” ({repo})"
        self._require_online(what)
        out = bytearray()
        await self._retrying(lambda: self._read_range(url, out, length, what), progress=lambda: len(out))
        return bytes(out[:length])

    async def readme(self, repo: str, revision: str = "main") -> str | None:
        """The repository's README.md (its model card) as text, cut at `README_MAX_BYTES`; None when it has none."""
        try:
            data = await self.read_prefix(repo, "README.md", README_MAX_BYTES, revision)
        except HubError as e:
            if e.missing_file:
                return None
            raise
        # a README cut in the middle of a character loses that character, not the rest
        return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=len(data) < README_MAX_BYTES)

    async def _read_range(self, url: str, out: bytearray, length: int, what: str) -> None:
        """One GET of bytes `len(out)`..`length - 1`, appended to `out` as they arrive (kept when it fails)."""
        start = len(out)
        if start >= length:
            return
        headers = await self.download_headers()
        headers["Range"] = f"bytes={start}-{max(start, length - 1)}"
        try:
            async with asyncio.timeout(self.request_timeout_s):
                client = await asyncio.to_thread(
                    httpx.AsyncClient, follow_redirects=True, timeout=HTTP_TIMEOUT, max_redirects=10
                )
                async with client, client.stream("GET", url, headers=headers) as response:
                    status = response.status_code
                    if status == 416 and start > 0:
                        return  # the file ends where the last try stopped
                    if status >= 400:
                        code = header_error_code(response.headers)
                        error = error_from_status(status, what=what, error_code=code)
                        error.retry_after_s = retry_after(response.headers.get("Retry-After"))
                        raise error
                    # a 206 ends where asked (read to its end: leaving httpcore's stream mid-way leaves it for the
                    # garbage collector); a 200 is the whole file: skip what we have, read only as far as needed
                    partial = status == 206
                    skip = 0 if partial else start
                    if partial:
                        got = parse_content_range(response.headers.get("Content-Range"))
                        if got is None or got[0] != start:
                            del out[:]  # an answer from elsewhere in the file: start over
                            raise HubError(f"The hub sent the wrong part of {what}.", "server", retryable=True)
                    async for chunk in response.aiter_bytes():
                        if skip:
                            cut = min(skip, len(chunk))
                            chunk, skip = chunk[cut:], skip - cut
                        out += chunk
                        if len(out) > length or (len(out) == length and not partial):
                            break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise error_from_exception(exc, what=what, endpoint=self.endpoint) from None


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """`bytes START-END/TOTAL` → (start, end, total or None for `*`); None when absent or malformed."""
    if not value:
        return None
    match = re.fullmatch(r"\s*bytes\s+(\d{1,16})-(\d{1,16})/(\d{1,16}|\*)\s*", value)
    if not match:
        return None
    start, end = int(match.group(1)), int(match.group(2))
    total = None if match.group(3) == "*" else int(match.group(3))
    if end < start or (total is not None and end >= total):
        return None
    return start, end, total


def header_error_code(headers: Mapping[str, str]) -> str | None:
    code = headers.get("X-Error-Code")
    return code if isinstance(code, str) and code.isascii() and len(code) < 64 else None
