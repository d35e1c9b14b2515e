"""Stores at s3://bucket/prefix: a local mirror to read them, a background uploader to write them.

Reading syncs the prefix into a per-user cache folder (only objects whose size or modification time
changed are downloaded; local files whose objects are gone are removed) and opens that folder as a
normal store. Writing records into a local staging folder exactly as for a local store, and an
`Uploader` thread mirrors that folder to the prefix every few seconds and at close. Object keys are
untrusted: only store-like names are mirrored, never outside the mirror folder, within a size cap.
Credentials, region and endpoint come from the standard AWS environment variables.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..errors import PerfscopeWarning, StoreError, one_line, warn_once
from ..words import counted
from .rollups import ROLLUP_DIR

SCHEME = "s3://"
#: the most bytes / objects one sync may bring into the mirror (a prefix is untrusted input)
MAX_BYTES_ENV = "PERFSCOPE_S3_MAX_BYTES"
MAX_OBJECTS_ENV = "PERFSCOPE_S3_MAX_OBJECTS"
DEFAULT_MAX_BYTES = 20 * 2**30
DEFAULT_MAX_OBJECTS = 200_000
#: where mirrors and staging folders live: $PERFSCOPE_CACHE_DIR, else $XDG_CACHE_HOME/perfscope
CACHE_ENV = "PERFSCOPE_CACHE_DIR"
#: seconds between two uploads of a staging folder
UPLOAD_INTERVAL_S = 2.0
#: a file that keeps growing (a live segment) is uploaded again at most once per interval per this
#: many bytes of it: re-sending a 64 MiB segment every 2 s would cost more than the training's I/O
REUPLOAD_BYTES_PER_INTERVAL = 8 << 20
#: a store file is at most <table>/<partition>/<file>; each part a plain name, not hidden
_MAX_DEPTH = 3
#: letters and digits of any script (run ids keep them), '_', and '.=+-' after the first character
_SAFE_PART = re.compile(r"\w[\w.=+-]{0,199}")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
#: the most folders a store's prefix may have: its mirror is as deep (a store is rarely more than 4 down)
MAX_PREFIX_DEPTH = 16
#: a prefix part that looks like a credential (`aws_secret_access_key=...`, an access key id): typed by
#: mistake, it must never become a folder name or be echoed back
_SECRET_PART = re.compile(
    r"(?i)(?:^|[_.+=-])(?:secret|password|passwd|token|credentials?|access_?key(?:_?id)?|api_?key|"
    r"signature|private_?key)(?:$|[_.+=-])|(?:AKIA|ASIA)[0-9A-Z]{16}"
)
_STATE = ".perfscope-mirror.json"
_LOCK = ".perfscope-mirror.lock"
#: in a staging folder: who writes it (pid, host, process start, address, endpoint), so that a later
#: writer can tell a killed one's folder (upload what it holds, then remove it) from a live one's
_OWNER = ".perfscope-owner.json"
_RECOVER_LOCK = ".perfscope-recover.lock"
#: set by `perfscope run` for its job: a tag in each staging folder's owner record, so that it can
#: find the folders its job left (uploads that failed) once the job has ended
RUN_TAG_ENV = "PERFSCOPE_S3_RUN_TAG"
_STAGING_TMP_PREFIX = "perfscope-s3-staging-"
#: the user info (`id:secret@`) of a URL, and a query string (`?X-Amz-Signature=...`): never printed
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s?#@]*@")
_URL_QUERY = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^\s?#]*)\?[^\s#'\"]*")


def is_s3_url(store: object) -> bool:
    """Whether `store` names an object-store prefix (s3://...) rather than a folder."""
    return isinstance(store, str) and store[:5].lower() == SCHEME


@dataclass(frozen=True)
class S3Location:
    bucket: str
    #: without leading or trailing slash; '' for the bucket's root
    prefix: str

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}".rstrip("/")

    @property
    def base(self) -> str:
        """The prefix as pyarrow's S3 filesystem names it."""
        return f"{self.bucket}/{self.prefix}".rstrip("/")


def parse_url(url: str) -> S3Location:
    """s3://bucket/prefix, checked: a bucket name S3 accepts and a prefix of plain names."""
    said = redact(one_line(url))  # the address as messages show it
    if not is_s3_url(url):
        raise StoreError(f"{said} is not an s3://bucket/prefix address")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/")
    shown_bucket = redact(one_line(bucket.partition("?")[0])) + ("?***" if "?" in bucket else "")
    if "@" in bucket:
        raise StoreError(
            f"s3://***@{redact(one_line(bucket.rpartition('@')[2]))}/...: an s3:// address holds no user "
            "name or password; credentials come from AWS_* variables"
        )
    if _SECRET_PART.search(prefix):
        raise StoreError(
            f"s3://{shown_bucket}/...: the prefix looks like it holds a credential (a secret, token, "
            "password or access key); it is not used. Give the store's address alone: credentials come "
            "from AWS_* variables"
        )
    if prefix.count("/") >= MAX_PREFIX_DEPTH:
        raise StoreError(
            f"s3://{shown_bucket}/...: the prefix is more than {MAX_PREFIX_DEPTH} folders deep; a "
            "store's address is a few"
        )
    if not _BUCKET.fullmatch(bucket):
        raise StoreError(
            f"{said}: {shown_bucket!r} is not a bucket name (3 to 63 lower-case letters, "
            "digits, dots and dashes)"
        )
    if prefix:
        for part in prefix.split("/"):
            if not _SAFE_PART.fullmatch(part):
                raise StoreError(
                    f"{said}: the prefix part {redact(one_line(part))!r} is not a plain name "
                    "(letters, digits, '_', '.', '=', '+', '-'; not starting with a dot)"
                )
    return S3Location(bucket, prefix)


def endpoint_url() -> str | None:
    """The S3 endpoint from the environment (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL): pyarrow
    does not read these itself. May hold credentials (`http://id:secret@host`): print it only
    through `redact`."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def redact(text: str) -> str:
    """`text` with the user info (`id:secret@`) and the query string (a signed URL's token) of every
    URL in it masked, and the endpoint's own user info wherever it appears: what every message that
    shows an endpoint, an address or an error of the S3 client goes through."""
    text = _URL_USERINFO.sub(r"\1***@", text)
    text = _URL_QUERY.sub(r"\1?***", text)
    endpoint = endpoint_url()
    if endpoint and "@" in endpoint:
        userinfo = _split_endpoint(endpoint)[1].netloc.rpartition("@")[0]
        for secret in {userinfo, *userinfo.split(":")}:
            if len(secret) >= 4:  # a word this short would mask ordinary text, and is no secret
                text = text.replace(secret, "***")
    return text


def _split_endpoint(endpoint: str) -> tuple[str, Any]:
    """(host[:port], the parsed URL) of an endpoint, the user info left out of the host."""
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    return parts.netloc.rpartition("@")[2], parts


def shown_endpoint() -> str:
    """The endpoint as messages show it: credentials and query masked."""
    endpoint = endpoint_url()
    return redact(one_line(endpoint)) if endpoint else "AWS"


def filesystem() -> Any:
    """A pyarrow S3 filesystem configured from the standard environment: credentials through the
    AWS SDK's own chain, the region from AWS_REGION / AWS_DEFAULT_REGION, the endpoint as above."""
    from pyarrow import fs

    kwargs: dict[str, Any] = {
        "connect_timeout": 5.0,
        "request_timeout": 30.0,
        # a dead endpoint answers in seconds, not after the SDK's ten tries
        "retry_strategy": fs.AwsStandardS3RetryStrategy(max_attempts=3),
        # one PUT per small object instead of a three-request multipart upload
        "allow_delayed_open": True,
    }
    endpoint = endpoint_url()
    if endpoint:
        # user info in the address is no credential the SDK takes (it would be read as a host name
        # and echoed in its errors): credentials come from the AWS_* variables
        host, parts = _split_endpoint(endpoint)
        kwargs["endpoint_override"] = host + parts.path.rstrip("/")
        kwargs["scheme"] = parts.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    elif endpoint:
        kwargs["region"] = "us-east-1"  # a custom endpoint: no region lookup through AWS itself
    return fs.S3FileSystem(**kwargs)


def _s3_problem(loc: S3Location, exc: BaseException) -> str:
    text = redact(one_line(str(exc)).strip()) or type(exc).__name__
    endpoint = endpoint_url()
    ignored = ""
    if endpoint and "@" in _split_endpoint(endpoint)[1].netloc:
        ignored = "; user info in the endpoint address is not used"
    return f"{loc.url}: {text[:400]} (endpoint {shown_endpoint()}{ignored}; credentials from AWS_* variables)"


def _limit(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise StoreError(f"{name}={one_line(raw)!r} is not a whole number") from None
    if value < 0:
        raise StoreError(f"{name}={value} is negative")
    return value


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "perfscope"


def _endpoint_name() -> str:
    """The endpoint as a folder name: its host and port (never its user info), else 'aws'."""
    endpoint = endpoint_url()
    host = _split_endpoint(endpoint)[0] if endpoint else ""
    return re.sub(r"[^A-Za-z0-9._-]", "_", host) if host else "aws"


def _endpoint_dir() -> Path:
    return cache_root() / "s3" / _endpoint_name()


def mirror_dir(loc: S3Location) -> Path:
    """The local folder that mirrors `loc`: one per endpoint, bucket and prefix."""
    return _endpoint_dir().joinpath(loc.bucket, *filter(None, loc.prefix.split("/")))


def mirror_path(url: str) -> Path:
    """The mirror folder of `url` (not made: the first sync makes it once the prefix was listed): a
    path that `open_store` reads as the store at `url`, for code that passes stores around as folders
    (the dashboard)."""
    return mirror_dir(parse_url(url))


def mirror_source(path: str | os.PathLike[str]) -> str | None:
    """The s3:// address whose mirror (for the endpoint of the environment) is the folder `path`."""
    try:
        rel = Path(path).resolve().relative_to(_endpoint_dir().resolve())
    except (ValueError, OSError, RuntimeError):
        return None
    if not rel.parts:
        return None
    url = SCHEME + "/".join(rel.parts)
    try:
        return parse_url(url).url
    except StoreError:
        return None


def key_problem(rel: str) -> str:
    """Why the object key `rel` (relative to the prefix) cannot be a store file, or ''."""
    if "\x00" in rel:
        return "holds a NUL byte"
    if rel.startswith("/"):
        return "is an absolute path"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' part"
    if len(parts) > _MAX_DEPTH:
        return f"lies deeper than {_MAX_DEPTH} folders"
    for p in parts:
        if not _SAFE_PART.fullmatch(p):
            return "has a part that is not a plain name (hidden, temporary, too long or odd characters)"
    return ""


def refuse_s3(store: object, doing: str) -> None:
    """For the commands that write or rewrite a local folder (simulate, demo, import, compact): an
    s3:// store is refused in one line saying what to do instead."""
    if is_s3_url(store):
        url = redact(one_line(str(store)))
        raise StoreError(
            f"{url}: {doing} needs a local folder; do it in one and copy that to S3 (aws s3 sync FOLDER "
            f"{url}). Recording (perfscope.profile, perfscope run) and reading (info, analyze, report, "
            "sql, dashboard) take s3:// addresses"
        )


# -- reading: the mirror ---------------------------------------------------------------------------
@contextlib.contextmanager
def _try_lock(path: Path) -> Iterator[bool]:
    """An exclusive lock on the file `path`, if no other process holds it: True when taken (the
    kernel lets go of it when its holder dies). False where it cannot be made or there is no flock."""
    try:
        import fcntl

        f = open(path, "a+b")  # noqa: SIM115 (held across the yield)
    except (ImportError, OSError):
        yield False
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One sync of a mirror at a time across processes (the CLI and a dashboard may share one)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(folder / _LOCK, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class _Object:
    """An object of a listing: its path as pyarrow names it (bucket/key), size and modification time."""

    path: str
    size: int
    mtime_ns: int | None


def _list_objects(s3: Any, loc: S3Location) -> list[_Object]:
    """Every object under the prefix. The SDK behind pyarrow lists without `encoding-type=url`, so one
    key holding a character XML 1.0 cannot carry (a NUL, a control character) makes the whole listing
    fail to parse: then the prefix is listed again, URL-encoded, and such a key is one more that
    `key_problem` names and the mirror skips."""
    from pyarrow import fs

    try:
        infos = s3.get_file_info(fs.FileSelector(loc.base, recursive=True, allow_not_found=True))
    except OSError as exc:
        if "XML" not in str(exc):
            raise
        return _list_url_encoded(loc)
    return [_Object(i.path, i.size or 0, i.mtime_ns) for i in infos if i.type == fs.FileType.File]


#: objects one page of a ListObjectsV2 answer holds at most (S3's own cap), and its XML namespace
_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def _credentials() -> tuple[str, str, str | None]:
    """(access key id, secret, session token): the AWS_* variables, else the AWS SDK's chain
    (profiles, instance roles) when botocore is installed."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return key, secret, os.environ.get("AWS_SESSION_TOKEN") or None
    try:
        import botocore.session

        found = botocore.session.get_session().get_credentials()
    except Exception:
        found = None
    if found is None:
        raise OSError(
            "no credentials for a URL-encoded listing (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
        )
    frozen = found.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token or None


def _signed_headers(
    host: str, uri: str, query: str, region: str, credentials: tuple[str, str, str | None], stamp: str
) -> dict[str, str]:
    """The headers of a GET of `uri?query` (both already URI-encoded, the query's pairs sorted) on
    `host`, signed with AWS signature version 4 at `stamp` (YYYYMMDDTHHMMSSZ)."""
    import hashlib
    import hmac

    key_id, secret, token = credentials
    scope = f"{stamp[:8]}/{region}/s3/aws4_request"
    empty = hashlib.sha256(b"").hexdigest()
    headers = {"host": host, "x-amz-content-sha256": empty, "x-amz-date": stamp}
    if token:
        headers["x-amz-security-token"] = token
    signed = ";".join(sorted(headers))
    canonical = "\n".join(
        ["GET", uri, query, *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed, empty]
    )
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    key = f"AWS4{secret}".encode()
    for part in (stamp[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={key_id}/{scope}, SignedHeaders={signed}, Signature={signature}"
    )
    return headers


def _list_url_encoded(loc: S3Location) -> list[_Object]:
    """ListObjectsV2 with `encoding-type=url`, signed with AWS signature version 4, path-style as
    pyarrow addresses buckets; keys decoded (a byte that is not UTF-8 kept as its escape)."""
    import datetime
    import urllib.error
    import urllib.request
    import xml.etree.ElementTree as ET
    from urllib.parse import quote, unquote_plus

    key_id, secret, token = _credentials()
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = endpoint_url()
    if endpoint:
        host, parts = _split_endpoint(endpoint)
        scheme, path = parts.scheme or "https", parts.path.rstrip("/")
        if scheme not in ("http", "https"):
            raise OSError(f"the endpoint {shown_endpoint()} is not an http:// or https:// address")
    else:
        scheme, host, path = "https", f"s3.{region}.amazonaws.com", ""
    uri = quote(f"{path}/{loc.bucket}", safe="/-_.~")
    found: list[_Object] = []
    after: str | None = None
    while True:
        query = {"list-type": "2", "encoding-type": "url", "prefix": f"{loc.prefix}/" if loc.prefix else ""}
        if after is not None:
            query["continuation-token"] = after
        canonical_query = "&".join(
            f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items())
        )
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        headers = _signed_headers(host, uri, canonical_query, region, (key_id, secret, token), stamp)
        del headers["host"]  # urllib sends the same one, from the URL
        req = urllib.request.Request(f"{scheme}://{host}{uri}?{canonical_query}", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as answer:  # http(s) only, checked above
                body = answer.read(64 << 20)
        except urllib.error.HTTPError as exc:
            raise OSError(f"ListObjectsV2 (URL-encoded) answered HTTP {exc.code}") from None
        root = ET.fromstring(body)
        for item in root.iter(f"{_S3_NS}Contents"):
            key = unquote_plus(item.findtext(f"{_S3_NS}Key") or "", errors="backslashreplace")
            if not key or key.endswith("/"):
                continue  # a folder marker
            when = item.findtext(f"{_S3_NS}LastModified")
            mtime_ns = None
            if when:
                with contextlib.suppress(ValueError):
                    moment = datetime.datetime.fromisoformat(when)
                    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
                    mtime_ns = (moment - epoch) // datetime.timedelta(microseconds=1) * 1000
            size = int(item.findtext(f"{_S3_NS}Size") or 0)
            found.append(_Object(f"{loc.bucket}/{key}", size, mtime_ns))
        if (root.findtext(f"{_S3_NS}IsTruncated") or "").lower() != "true":
            return found
        after = root.findtext(f"{_S3_NS}NextContinuationToken")
        if not after:
            return found


def sync_mirror(url: str) -> Path:
    """Bring the mirror of `url` up to date and return its folder. StoreError, in one line, when the
    prefix cannot be listed, holds no store files, or exceeds the caps."""
    loc = parse_url(url)
    mirror = mirror_dir(loc)
    max_bytes = _limit(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)
    max_objects = _limit(MAX_OBJECTS_ENV, DEFAULT_MAX_OBJECTS)
    try:
        s3 = filesystem()
        infos = _list_objects(s3, loc)
    except Exception as exc:
        raise StoreError(f"cannot list {_s3_problem(loc, exc)}") from None
    wanted: dict[str, Any] = {}
    odd: list[str] = []
    for info in infos:
        rel = info.path[len(loc.base) + 1 :] if loc.base else info.path
        problem = key_problem(rel)
        if problem:
            odd.append(f"'{one_line(rel)}' {problem}")
        else:
            wanted[rel] = info
    if len(wanted) > max_objects:
        raise StoreError(
            f"{loc.url} holds {len(wanted):,} objects, more than the {max_objects:,} perfscope mirrors "
            f"(set {MAX_OBJECTS_ENV} to allow more)"
        )
    total = sum(i.size or 0 for i in wanted.values())
    if total > max_bytes:
        raise StoreError(
            f"{loc.url} holds {total:,} bytes, more than the {max_bytes:,} perfscope mirrors "
            f"(set {MAX_BYTES_ENV} to allow more)"
        )
    if not wanted:
        raise StoreError(
            f"{loc.url} holds no perfscope store files"
            + (f" ({counted(len(odd), 'object')} with names no store file has)" if odd else "")
            + ". Record into it with perfscope.profile('s3://...') or perfscope run --store s3://..."
        )
    with _locked(mirror):
        root = mirror.resolve()
        state_path = mirror / _STATE
        try:
            state = json.loads(state_path.read_text())
            if not isinstance(state, dict):
                state = {}
        except (OSError, ValueError):
            state = {}
        todo = []
        for rel, info in wanted.items():
            sig = [info.size, info.mtime_ns]
            dest = mirror.joinpath(*rel.split("/"))
            if state.get(rel) == sig and dest.is_file() and dest.stat().st_size == info.size:
                continue
            todo.append((rel, info, dest))
        budget = _Budget(max_bytes)
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda t: _download(s3, loc, root, t[1], t[2], budget), todo))
        for (rel, info, _), problem in zip(todo, results, strict=True):
            if problem:
                odd.append(f"'{one_line(rel)}' {problem}")
                state.pop(rel, None)
            else:
                state[rel] = [info.size, info.mtime_ns]
        if budget.exceeded:
            raise StoreError(
                f"{loc.url} grew past {max_bytes:,} bytes while it was read "
                f"(set {MAX_BYTES_ENV} to allow more)"
            )
        _remove_unlisted(mirror, set(wanted))
        state = {k: v for k, v in state.items() if k in wanted}
        tmp = state_path.with_name(f"{_STATE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, state_path)
    if odd:
        listed = "; ".join(odd[:5]) + (f"; ... and {len(odd) - 5} more" if len(odd) > 5 else "")
        skipped = counted(len(odd), "object")
        warnings.warn(f"perfscope: {loc.url}: skipped {skipped}: {listed}", PerfscopeWarning, 2)
    return mirror


class _Budget:
    """Bytes downloaded by one sync, shared by its threads: an object that grows after the listing
    cannot carry the mirror past the cap."""

    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes
        self.exceeded = False
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            self.left -= n
            if self.left < 0:
                self.exceeded = True
            return not self.exceeded


def _download(s3: Any, loc: S3Location, root: Path, info: Any, dest: Path, budget: _Budget) -> str:
    """Fetch one object into `dest` (temporary name, then rename); '' or why it was not."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.parent.resolve().is_relative_to(root):  # a link planted in the mirror
            return "would be written outside the mirror folder"
        if dest.is_symlink() or (dest.exists() and not dest.is_file()):
            return "collides with a folder or link of the mirror"
    except OSError as exc:
        return f"cannot be placed in the mirror ({one_line(exc.strerror or str(exc))})"
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, s3.open_input_stream(info.path) as src:
            while chunk := src.read(1 << 20):
                if not budget.take(len(chunk)):
                    return "exceeds the size cap"
                out.write(chunk)
        os.replace(tmp, dest)
        return ""
    except Exception as exc:
        return f"could not be downloaded ({_s3_problem(loc, exc)})"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _remove_unlisted(mirror: Path, keep: set[str]) -> None:
    """Remove the mirror's files whose objects are gone, and the folders left empty."""
    for dirpath, _, filenames in os.walk(mirror, topdown=False):
        d = Path(dirpath)
        for name in filenames:
            rel = (d / name).relative_to(mirror).as_posix()
            if name.startswith(".") or rel in keep:
                continue  # our own state, or a file no object can be (a reader's cache, a lock)
            with contextlib.suppress(OSError):
                (d / name).unlink()
        if d != mirror:
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty


# -- writing: the uploader -------------------------------------------------------------------------
def staging_dir(loc: S3Location) -> Path:
    """A fresh local folder this process records into before its files are uploaded to `loc`: in the
    cache folder, else (a read-only home on a cluster node) in the temporary folder."""
    prefix = f"{loc.bucket}-{os.getpid()}-"
    try:
        parent = cache_root() / "s3-staging"
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError:
        return Path(tempfile.mkdtemp(prefix=f"{_STAGING_TMP_PREFIX}{prefix}"))


def _write_owner(folder: Path, loc: S3Location) -> None:
    """The owner record of a staging folder (pid, host, process start, address, endpoint, the tag of
    `perfscope run`): with it a later writer can tell this one's folder, once it is killed, from a
    live writer's and clean it up (`Uploader.recover_staging`); a folder without one is never
    touched."""
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _process_start(os.getpid()),
        "url": loc.url,
        "endpoint": _endpoint_name(),
        "tag": os.environ.get(RUN_TAG_ENV) or None,
    }
    tmp = folder / f"{_OWNER}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / _OWNER)


def _process_start(pid: int) -> str | None:
    """When process `pid` started, as a mark that a later process of the same pid cannot have: the
    boot id and the start time in clock ticks since boot (Linux), else psutil's start time to the
    millisecond; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{int(fields[19])}"  # field 22 of stat(5); the split starts at field 3
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return f"t:{psutil.Process(pid).create_time():.3f}"
    except Exception:
        return None


def _owner_dead(record: dict[str, Any]) -> bool:
    """Whether the writer of an owner record has ended: on this host, and its pid is gone, a zombie,
    or a later process's. Anything in doubt (another host, a record of another shape, a start time
    that cannot be read) is alive: a live writer's folder is never touched."""
    pid, started = record.get("pid"), record.get("started")
    if record.get("host") != socket.gethostname() or type(pid) is not int or not isinstance(started, str):
        return False
    try:
        import psutil

        process = psutil.Process(pid)
        if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return True
    except psutil.NoSuchProcess:
        return True
    except Exception:
        return False
    now = _process_start(pid)
    return now is not None and now != started


def _staging_folders() -> list[Path]:
    """Every staging folder of this user: in the cache folder and in the temporary folder."""
    found: list[Path] = []
    for parent, prefix in (
        (cache_root() / "s3-staging", ""),
        (Path(tempfile.gettempdir()), _STAGING_TMP_PREFIX),
    ):
        try:
            with os.scandir(parent) as it:
                for e in it:
                    if (
                        e.name.startswith(prefix)
                        and e.is_dir(follow_symlinks=False)
                        and e.stat(follow_symlinks=False).st_uid == os.getuid()
                    ):
                        found.append(Path(e.path))
        except OSError:
            continue
    return found


def _owner(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((folder / _OWNER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def kept_staging(tag: str) -> list[tuple[Path, int]]:
    """The staging folders left by the writers `perfscope run` tagged `tag` (their upload failed, or
    they were killed), with how many store files each holds."""
    kept = []
    for folder in _staging_folders():
        record = _owner(folder)
        if record is not None and record.get("tag") == tag:
            kept.append((folder, len(_store_files(folder))))
    return sorted(kept)


def _store_files(folder: Path, odd: list[tuple[str, str]] | None = None) -> dict[str, tuple[int, int]]:
    """The files of a staging folder an upload sends: relative path -> (size, mtime_ns); those whose
    name no object key of a store may have go to `odd` as (path, why) instead. Not its rollups: the
    merge at a writer's close builds them from that one process's rows, so on the shared store they
    would be stale, and every process of a run would replace the others' at the same key."""
    found: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        top = Path(dirpath) == folder
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not (top and d == ROLLUP_DIR)]
        for name in filenames:
            path = Path(dirpath) / name
            if name.startswith(".") or name.endswith(".tmp"):
                continue  # being written
            rel = path.relative_to(folder).as_posix()
            problem = key_problem(rel)
            if problem:
                if odd is not None:
                    odd.append((rel, problem))
                continue
            try:
                st = path.lstat()
            except OSError:
                continue  # removed meanwhile
            if os.path.isfile(path) and not path.is_symlink():
                found[rel] = (st.st_size, st.st_mtime_ns)
    return found


def _complete(path: Path) -> bool:
    """Whether a file a killed writer left is a whole store file: a Parquet segment with its footer,
    a live segment with at least one complete batch (its torn tail is left out by every reader)."""
    from .live import LIVE_SUFFIX, read_live

    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.read_metadata(path)
            return True
        if path.suffix == LIVE_SUFFIX:
            return read_live(path) is not None
    except Exception:
        return False
    return True


class Uploader:
    """Mirrors a local folder to an S3 prefix from a background thread: new or changed files are
    uploaded (a PUT is atomic: a reader never sees half an object), then objects whose file was
    removed are deleted. Temporary and hidden names are never uploaded. Failures become one warning
    through `warn`; the folder is removed at close once everything in it is uploaded."""

    def __init__(
        self,
        url: str,
        staging: Path,
        *,
        warn: Callable[[str, str], object] | None = None,
        interval_s: float = UPLOAD_INTERVAL_S,
    ) -> None:
        self.location = parse_url(url)
        self.staging = Path(staging)
        self.interval_s = interval_s
        #: warn(kind, message): Faults.report in a profiler
        self._warn = warn or (lambda kind, m: warn_once(f"perfscope-{kind}-{self.location.url}", m))
        self._warned = False
        #: relative path -> (size, mtime_ns) of the version uploaded
        self.uploaded: dict[str, tuple[int, int]] = {}
        #: relative path -> when (monotonic s) a changed version may be uploaded again
        self._not_before: dict[str, float] = {}
        self._s3: Any = None
        self._stop = threading.Event()
        #: set at interpreter exit: the clean-up of killed writers' folders stops between two files
        #: (a close waits for it: the next writer would otherwise find the same folders again)
        self._abandon = threading.Event()
        self._pass_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failures = 0

    def start(self) -> Uploader:
        self._thread = threading.Thread(target=self._run, name="perfscope-s3-uploader", daemon=True)
        self._thread.start()
        # pyarrow.fs registers its S3 finaliser at import: imported first, it runs after our hook
        import pyarrow.fs  # noqa: F401

        atexit.register(self._at_exit)
        return self

    def _at_exit(self) -> None:
        """An upload pass at interpreter exit, for an owner that never closes. Not a close: the
        profiler's own exit hook may still write the run's last rows and close us after this."""
        self._stop.set()  # no pass of the thread may run into pyarrow's S3 finaliser
        self._abandon.set()
        if self._thread is not None:
            self._thread.join(60.0)
        self.sync_once(final=True)

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # a clean-up of others' folders never stops ours
            self.recover_staging()
        while not self._stop.wait(self.interval_s):
            self.sync_once()

    def recover_staging(self) -> list[Path]:
        """Clean up after killed writers of this user and endpoint: each staging folder whose owner
        has ended (see `_owner_dead`) has its whole store files uploaded to the address it was made
        for (those already there, by size, are not sent again) and is then removed; a folder whose
        upload fails is kept for the next writer. Returns the folders removed."""
        removed = []
        for folder in _staging_folders():
            if self._abandon.is_set():
                break
            record = _owner(folder)
            if (
                folder == self.staging
                or record is None
                or record.get("endpoint") != _endpoint_name()
                or not _owner_dead(record)
            ):
                continue
            with _try_lock(folder / _RECOVER_LOCK) as mine:  # one recovering writer per folder
                if mine and folder.is_dir() and self._recover(folder, str(record.get("url"))):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder)
        return removed

    def _recover(self, folder: Path, url: str) -> bool:
        """Upload what a killed writer's folder holds that is not on S3 yet; True when all of it is."""
        from pyarrow import fs

        try:
            loc = parse_url(url)
            if self._s3 is None:
                self._s3 = filesystem()
            files = _store_files(folder)
            for rel, (size, _) in sorted(files.items()):
                if self._abandon.is_set():
                    return False
                path = folder / rel
                if rel.endswith(".arrows") and f"{rel.removesuffix('.arrows')}.parquet" in files:
                    continue  # sealed: its Parquet twin holds its rows
                remote = self._s3.get_file_info(f"{loc.base}/{rel}")
                if remote.type == fs.FileType.File and remote.size == size:
                    continue  # uploaded before the kill
                if not _complete(path):
                    continue  # a file torn by the kill: no reader could use it
                data = path.read_bytes()
                with self._s3.open_output_stream(f"{loc.base}/{rel}") as out:
                    out.write(data)
            return True
        except Exception:
            return False  # kept: the next writer tries again

    def _local_files(self) -> dict[str, tuple[int, int]]:
        odd: list[tuple[str, str]] = []
        found = _store_files(self.staging, odd)
        for rel, problem in odd:  # readers would skip it too: say so once, not silently
            self._warn("s3_upload_skipped", f"perfscope: {rel!r} is not uploaded: it {problem}")
        return found

    def sync_once(self, *, final: bool = False) -> bool:
        """One pass: upload what is new or changed (changed files first, so a sealed file's final
        version lands before what replaces it), then delete what is gone. True when all succeeded.
        A large growing file waits longer between uploads, unless new files arrived (a roll or a
        seal: everything goes up together) or this is the `final` pass."""
        with self._pass_lock:
            try:
                if self._s3 is None:
                    self._s3 = filesystem()
                local = self._local_files()
                changed = [r for r, sig in local.items() if self.uploaded.get(r) != sig]
                now = time.monotonic()
                if not final and all(r in self.uploaded for r in changed):
                    changed = [r for r in changed if now >= self._not_before.get(r, 0.0)]
                # files already up first (a sealed segment's final version), then the new ones
                for batch in (
                    [r for r in changed if r in self.uploaded],
                    [r for r in changed if r not in self.uploaded],
                ):
                    for rel in _in_parallel(lambda r: self._put(r, local[r]), batch):
                        extra_intervals = max(0.0, local[rel][0] / REUPLOAD_BYTES_PER_INTERVAL - 1.0)
                        self._not_before[rel] = now + extra_intervals * self.interval_s
                for rel in [r for r in self.uploaded if r not in local]:
                    with contextlib.suppress(FileNotFoundError):
                        self._s3.delete_file(f"{self.location.base}/{rel}")
                    del self.uploaded[rel]
                    self._not_before.pop(rel, None)
                return True
            except Exception as exc:
                self.failures += 1
                then = (
                    "the recording is kept there (upload it with any S3 tool, or read it there)"
                    if final
                    else f"recording goes on there and the upload is retried every {self.interval_s:g} s"
                )
                self._warned = True
                self._warn(
                    "s3_upload_failed",
                    f"perfscope: cannot upload {self.staging} to {_s3_problem(self.location, exc)}; {then}",
                )
                return False

    def _put(self, rel: str, sig: tuple[int, int]) -> str:
        path = self.staging / rel
        try:
            # read first: the bytes of one moment, whatever the writer appends meanwhile
            data = path.read_bytes()
        except FileNotFoundError:
            return rel  # removed since the scan (a compaction): the next pass deletes its object
        with self._s3.open_output_stream(f"{self.location.base}/{rel}") as out:
            out.write(data)
        with self._state_lock:
            self.uploaded[rel] = sig
        return rel

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the thread, upload what is left, and remove the staging folder when all of it is on
        S3 (else keep it and say where). Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self._at_exit)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # still cleaning up killed writers' folders: stop between files
                self._abandon.set()
                self._thread.join(timeout_s)
        if self.sync_once(final=True) and not self._local_files().keys() - self.uploaded.keys():
            shutil.rmtree(self.staging, ignore_errors=True)
        elif not self._warned:  # the one warning already said where the recording is
            self._warn(
                "s3_upload_incomplete",
                f"perfscope: the store could not be fully uploaded to {self.location.url}; the "
                f"recording is kept in {self.staging} (upload it with any S3 tool, or read it there)",
            )


#: PUTs in flight at once in one upload pass (S3 latency, not bandwidth, bounds a pass of small files)
UPLOADS_IN_FLIGHT = 8


def _in_parallel(put: Callable[[str], str], rels: list[str]) -> list[str]:
    """put(rel) for each of `rels` on a few threads; the first failure is raised once all are done."""
    if len(rels) <= 1:
        return [put(r) for r in rels]
    futures = []
    with ThreadPoolExecutor(max_workers=min(UPLOADS_IN_FLIGHT, len(rels))) as pool:
        try:
            for r in rels:
                futures.append(pool.submit(put, r))
        except RuntimeError:  # at interpreter exit no new pool thread may start: the rest in turn
            pass
    done = [f.result() for f in futures]
    return done + [put(r) for r in rels[len(futures) :]]


def start_upload(url: str, warn: Callable[[str, str], object] | None = None) -> Uploader:
    """The uploader of a new staging folder for `url`, started: record into `uploader.staging`. Its
    thread first cleans up the folders of killed writers (`Uploader.recover_staging`)."""
    loc = parse_url(url)
    staging = staging_dir(loc)
    with contextlib.suppress(OSError):  # without a record the folder is only never cleaned up by others
        _write_owner(staging, loc)
    return Uploader(url, staging, warn=warn, interval_s=UPLOAD_INTERVAL_S).start()


def open_mirrored(url: str, *, allow_empty: bool = False, warn: bool = True) -> Any:
    """The store at `url`, read through its local mirror; `refresh` syncs the mirror again first."""
    from .reader import Store

    class MirroredStore(Store):
        #: the s3:// address this store mirrors
        source = url

        def refresh(self) -> None:
            sync_mirror(url)
            super().refresh()

    # the folder is made by the store's first refresh (sync_mirror), once the prefix was listed: an
    # address that cannot be read leaves nothing behind in the cache
    return MirroredStore(mirror_dir(parse_url(url)), allow_empty=allow_empty, warn=warn)
