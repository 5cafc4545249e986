"""One GET over HTTP(S) for `storage.web`: a byte range or a small whole file, through `requests`, failures as one line.

The session (one per thread) retries a refused or reset connection and HTTP 429/5xx answers at most `RETRIES` times,
backing off `BACKOFF_S` × 2^n seconds (a `Retry-After` is not waited for: it may say an hour); every wait for the
server is bounded by `timeout_s()` (`INSPECT_HTTP_TIMEOUT`, default 60 s). A body cut short is asked again as many
times. Each request names the tool in its User-Agent and asks for the bytes as stored (`Accept-Encoding: identity`).

A range is asked as `Range: bytes=A-B`; the answer must be HTTP 206 for exactly those bytes (fewer only at the end
of the file). A server that answers with the whole file (200) is refused without reading its body, unless the whole
file is no more than what was asked.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import urllib.parse

from inspect_tool import process_state
from inspect_tool import __version__
from inspect_tool import errors
from inspect_tool.storage import remote

TIMEOUT_ENV = "INSPECT_HTTP_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
RETRIES = 3
BACKOFF_S = 0.5
RETRY_STATUS = (429, 500, 502, 503, 504)
PIECE = 8 << 20  # bytes read from a socket at a time
USER_AGENT = f"inspect_checkpoint/{__version__}"
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$", re.I)
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")
_TIMED_OUT = re.compile(r"ReadTimeoutError|ConnectTimeoutError|timed out", re.I)
_QUOTED = re.compile(r"'([^']{3,})'")
_POOL_HOST = re.compile(r"host='([^']+)', port=(\d+)")
_RESOLVE = re.compile(r"NameResolution|Name or service not known|nodename nor servname|Temporary failure in name "
                      r"resolution|getaddrinfo failed|No address associated", re.I)
_local = threading.local()


def _forget_sessions() -> None:
  global _local  # pylint: disable=global-statement
  _local = threading.local()  # every thread's session goes with it (a thread still running keeps its own)


process_state.declare(f"{__name__}:_local", process_state.CACHE, lambda: bool(vars(_local)), _forget_sessions)


@dataclasses.dataclass
class Answer:
  """What a GET brought: the HTTP status, its headers, the file's size when told, the bytes read (None: not read)."""

  status: int
  headers: dict
  total: int | None
  data: bytearray | None = None
  moved_to: str | None = None  # where redirects led


class Short(Exception):
  """A body ended before the bytes its headers announced."""


def timeout_s() -> float:
  """Seconds to wait for a server at each step (`INSPECT_HTTP_TIMEOUT`, a positive number; default 60)."""
  return remote.timeout_s(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def session():
  """This thread's `requests.Session`, with the bounded retries of the module."""
  found = getattr(_local, "session", None)
  if found is None:
    # lazy: requests and urllib3, ~0.15 s to import: `hf --path` of a local directory loads this module without them
    import requests  # pylint: disable=import-outside-toplevel
    from urllib3.util import retry  # pylint: disable=import-outside-toplevel

    policy = retry.Retry(total=RETRIES, connect=RETRIES, read=RETRIES, status=RETRIES, backoff_factor=BACKOFF_S,
                         status_forcelist=RETRY_STATUS, allowed_methods=frozenset({"GET"}), raise_on_status=False,
                         respect_retry_after_header=False)
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # its "Retrying ..." lines: ours is one line
    found = requests.Session()
    adapter = requests.adapters.HTTPAdapter(max_retries=policy)
    found.mount("http://", adapter)
    found.mount("https://", adapter)
    found.headers["User-Agent"] = f"{USER_AGENT} python-requests/{requests.__version__}"
    _local.session = found
  return found


def host(url: str) -> str:
  return urllib.parse.urlsplit(url).netloc or url


def get(url: str, shown: str, *, start: int | None = None, stop: int | None = None, headers: dict | None = None,
        max_bytes: int | None = None) -> Answer:
  """GETs `url` (`shown` names it in errors): bytes [start, stop) by a range, or the whole file when `start` is None
  (its body left unread when over `max_bytes`). A status of 300 and up comes back with no data, for the caller to
  word; a failed transport, a refused range or a body cut short (after the retries) raise one line."""
  # lazy: requests, ~0.1 s to import: `hf --path` of a local directory loads this module without it
  import requests  # pylint: disable=import-outside-toplevel

  asked = {"Accept-Encoding": "identity", **(headers or {})}
  if start is not None:
    asked["Range"] = f"bytes={start}-{stop - 1}"
  wait = timeout_s()
  for attempt in range(RETRIES + 1):
    try:
      with session().get(url, headers=asked, stream=True, timeout=(wait, wait)) as response:
        answer = _answer(response, shown, start, stop, max_bytes)
        answer.moved_to = response.url if response.history else None
        return answer
    except Short as e:
      if attempt == RETRIES:
        raise errors.CheckpointError(f"{shown}: {host(url)} {e}; gave up after {RETRIES + 1} tries") from None
    except requests.RequestException as e:
      raise transport_error(url, shown, e) from None
  raise AssertionError("unreachable")


def _answer(response, shown: str, start: int | None, stop: int | None, max_bytes: int | None) -> Answer:
  headers = {k.lower(): v for k, v in response.headers.items()}
  status = response.status_code
  length = _int(headers.get("content-length"))
  if status == 416:  # the range starts at or past the end: "bytes */SIZE"
    return Answer(416, headers, _content_range(headers, shown)[2], bytearray())
  if status >= 300:
    return Answer(status, headers, None)
  if start is None:
    if max_bytes is not None and length is not None and length > max_bytes:
      return Answer(status, headers, length)  # too large: the body is left unread
    data = _body(response, length, max_bytes)
    return Answer(status, headers, len(data) if length is None else length, data)
  if status == 200:
    if start == 0 and length is not None and length <= stop:  # the whole file is no more than what was asked
      return Answer(206, headers, length, _body(response, length, None))
    raise errors.CheckpointError(f"{shown}: the server {host(response.url)} does not honour byte ranges (it answered "
                                 f"Range: bytes={start}-{stop - 1} with the whole file, HTTP 200); accepted: a server "
                                 "that answers ranges (HTTP 206), as the Hub, object stores and nginx do")
  if status != 206:
    raise errors.CheckpointError(f"{shown}: {host(response.url)} answered a byte range with HTTP {status}; expected 206")
  first, last, total = _content_range(headers, shown)
  end = stop if total is None else min(stop, total)
  if first != start or last is None or last + 1 != end:
    told = headers.get("content-range", "no Content-Range")
    raise errors.CheckpointError(f"{shown}: {host(response.url)} sent other bytes than asked ({told} for "
                                 f"bytes={start}-{stop - 1})")
  return Answer(206, headers, total, _body(response, end - start, None))


def _body(response, length: int | None, cap: int | None) -> bytearray:
  """The body: exactly `length` bytes when told (fewer is `Short`), else as sent, cut after `cap` + 1 bytes."""
  # lazy: requests, ~0.1 s to import: `hf --path` of a local directory loads this module without it
  import requests  # pylint: disable=import-outside-toplevel
  import urllib3  # pylint: disable=import-outside-toplevel

  data, got = bytearray(length or 0), 0
  try:
    if length is None:
      for piece in response.iter_content(PIECE):
        data += piece
        if cap is not None and len(data) > cap:
          break
      return data
    view = memoryview(data)
    while got < length:  # in pieces: urllib3's readinto copies through a buffer of the size asked
      count = response.raw.readinto(view[got:got + PIECE])
      if not count:
        break
      got += count
  except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
    raise Short(f"closed the connection after {got} of {length} bytes ({errors.first_line(e)})") from None
  if got < length:
    raise Short(f"sent {got} of the {length} bytes it announced")
  return data


def _int(text: str | None) -> int | None:
  return int(text) if text is not None and text.strip().isdigit() else None


def _content_range(headers: dict, shown: str) -> tuple[int | None, int | None, int | None]:
  """(first, last, total) of `Content-Range` (None where it says `*`); a missing or malformed one is refused."""
  match = _CONTENT_RANGE.match(headers.get("content-range", ""))
  if not match:
    raise errors.CheckpointError(f"{shown}: the answer to a byte range has Content-Range "
                                 f"{errors.shown(headers.get('content-range'))}; expected 'bytes FIRST-LAST/SIZE'")
  first, last, total = (int(g) if g and g != "*" else None for g in match.groups())
  return first, last, total


def transport_error(url: str, shown: str, e: BaseException) -> errors.CheckpointError:
  """The one line for a GET that got no answer: unknown host, refused, timed out, TLS, too many redirects."""
  # lazy: requests, ~0.1 s to import: `hf --path` of a local directory loads this module without it
  import requests  # pylint: disable=import-outside-toplevel

  where, text = host(url), errors.first_line(e)
  tries = f"; gave up after {RETRIES + 1} tries"
  if isinstance(e, requests.Timeout) or _TIMED_OUT.search(str(e)):
    return errors.CheckpointError(f"{shown}: {where} did not answer within {timeout_s():g} s{tries} ({TIMEOUT_ENV} "
                                  "sets the limit)")
  if isinstance(e, requests.exceptions.SSLError):
    return errors.CheckpointError(f"{shown}: TLS failure talking to {where} ({text})")
  if isinstance(e, requests.TooManyRedirects):
    return errors.CheckpointError(f"{shown}: {where} redirected too many times")
  if isinstance(e, (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema,
                    requests.exceptions.InvalidSchema)):
    return errors.CheckpointError(f"{shown}: not a URL that can be fetched ({text})")
  if isinstance(e, requests.ConnectionError):
    pool = _POOL_HOST.search(str(e))  # the host that failed: a redirect's target, maybe
    where = f"{pool.group(1)}:{pool.group(2)}" if pool else where
    if _RESOLVE.search(str(e)):
      return errors.CheckpointError(f"{shown}: cannot resolve the host {where} (no network, or no such host){tries}")
    reason = _ERRNO.search(str(e)) or (_QUOTED.findall(str(e)) or [None])[-1]
    why = (reason.group(1) if isinstance(reason, re.Match) else reason or text).strip().rstrip(".")
    return errors.CheckpointError(f"{shown}: cannot reach {where} ({why[:1].lower() + why[1:]}){tries}")
  return errors.CheckpointError(f"{shown}: cannot be read from {where} ({text})")
