"""The processes of one `export` or `import` job, talking over TCP through process 0 (no JAX runtime, no Gloo).

Those commands need no collective computation, only agreement: every process writes its own share of the
checkpoint, and the processes exchange a few short texts (the plan's fingerprint, the temporary directory, "done").
`Job` does that with bounded waits and one-line failures, which `jax.distributed` cannot promise (a dead peer is
a SIGABRT with a C++ trace there, an unreachable coordinator a 2-minute hang):

- process 0 listens on the coordinator's port, the others connect to it (retrying until `timeout`, or for
  `REFUSED_S` while the port refuses, nobody listening, unless --timeout is given); a process that fails before
  joining (a bad input of its own) tells process 0 (`notify_failure`), which ends the job with its line;
- `exchange(tag, text)` is an all-gather through process 0: every process gets every process's text;
- every process sends a heartbeat every few seconds from a thread, so a wait ends with `JobError` after
  `timeout` seconds of silence (a stopped or unreachable process), at once when a peer's connection closes (a
  killed process), and with the peer's own message when it failed (`fail`, relayed by process 0 to all).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

from inspect_tool import errors

_HEADER = struct.Struct(">I")
_MAX_FRAME = 1 << 20
_FRAME, _BEAT = b"F", b"H"  # a message (length, JSON) follows; a heartbeat


class JobError(errors.InspectError):
  """The job cannot go on: a process failed, ended, or went silent for longer than the timeout."""


class _Peer:
  """One connection, its frames length-prefixed JSON; sends are serialized (the heartbeat thread sends too)."""

  def __init__(self, sock: socket.socket, name: str):
    self.sock, self.name, self._lock = sock, name, threading.Lock()

  def send(self, message: dict) -> None:
    data = json.dumps(message).encode()
    with self._lock:
      self.sock.sendall(_FRAME + _HEADER.pack(len(data)) + data)

  def beat(self) -> None:
    """One heartbeat byte: sent whole or not at all, so a full buffer (a peer busy for hours) corrupts nothing."""
    with self._lock:
      self.sock.send(_BEAT)

  def recv(self, timeout: float, waiting_for: str) -> dict:
    """The next message; something (a message or a heartbeat) must come at least every `timeout` seconds."""
    while True:
      kind = self._read(1, timeout, waiting_for)
      if kind == _BEAT:
        continue
      (size,) = _HEADER.unpack(self._read(_HEADER.size, timeout, waiting_for))
      if kind != _FRAME or size > _MAX_FRAME:
        raise JobError(f"{self.name} sent something else than this tool's messages; accepted at --coordinator: "
                       "the processes of one inspect_checkpoint job")
      try:
        return json.loads(self._read(size, timeout, waiting_for))
      except ValueError:
        raise JobError(f"{self.name} sent a message that is not JSON") from None

  def _read(self, size: int, timeout: float, waiting_for: str) -> bytes:
    out = b""
    self.sock.settimeout(timeout)
    while len(out) < size:
      try:
        chunk = self.sock.recv(size - len(out))
      except socket.timeout:
        raise JobError(f"{self.name} sent nothing for {timeout:g} s while this process waited for "
                       f"{waiting_for} (see --timeout)") from None
      except (ConnectionResetError, ConnectionAbortedError):  # killed with our bytes unread: its kernel resets
        raise JobError(f"{self.name} ended (its connection was reset) while this process waited for "
                       f"{waiting_for}") from None
      except OSError as e:
        raise JobError(f"{self.name} is gone ({e.strerror or type(e).__name__}) while this process waited for "
                       f"{waiting_for}") from None
      if not chunk:
        raise JobError(f"{self.name} ended while this process waited for {waiting_for}")
      out += chunk
    return out

  def close(self) -> None:
    try:
      self.sock.close()
    except OSError:
      pass


REFUSED_S = 15.0  # seconds a process keeps retrying a coordinator that refuses (nobody listens) without --timeout
NOTIFY_S = 5.0  # seconds a process that failed before joining tries to tell process 0


def notify_failure(host: str, port: int, count: int, index: int, message: str, wait_s: float = NOTIFY_S) -> bool:
  """Process `index` failed before joining (a bad input): tells process 0, best effort, within `wait_s`."""
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline:
    try:
      sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
    except OSError:
      time.sleep(0.2)
      continue
    peer = _Peer(sock, "process 0")
    try:
      peer.send({"hello": index, "count": count, "fail": message})
      return True
    except (OSError, JobError):
      return False
    finally:
      peer.close()
  return False


class Job:
  """Process `index` of `count`, coordinated by process 0 at `host:port` (see the module docstring)."""

  def __init__(self, host: str, port: int, count: int, index: int, timeout: float, *, refused_s: float | None = None):
    self.index, self.count, self.timeout = index, count, float(timeout)
    self.refused_s = self.timeout if refused_s is None else min(float(refused_s), self.timeout)
    self._peers: list[_Peer] = []
    self._closed = threading.Event()
    if index == 0:
      self._listen(port)
    else:
      self._connect(host, port)
    self._beat = threading.Thread(target=self._heartbeat, name="job-heartbeat", daemon=True)
    self._beat.start()

  def _listen(self, port: int) -> None:
    try:
      if socket.has_dualstack_ipv6():  # every address of this host, IPv4 and IPv6 (as JAX's [::]:port)
        server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
      else:
        server = socket.create_server(("", port))
    except OSError as e:
      raise errors.InputError(f"--coordinator port {port} cannot be listened on by process 0 "
                              f"({e.strerror or type(e).__name__}); accepted: a free port of this host") from None
    deadline = time.monotonic() + self.timeout
    waiting: dict[int, _Peer] = {}
    try:
      while len(waiting) < self.count - 1:
        left = deadline - time.monotonic()
        if left <= 0:
          missing = sorted(set(range(1, self.count)) - set(waiting))
          message = (f"process(es) {', '.join(map(str, missing))} of --num-processes {self.count} did not join "
                     f"within {self.timeout:g} s (see --timeout)")
          self._peers = list(waiting.values())
          self.fail(message)
          raise JobError(message)
        server.settimeout(left)
        try:
          sock, _ = server.accept()
        except socket.timeout:
          continue
        peer = _Peer(sock, "a process")
        try:
          hello = peer.recv(min(left, 10.0), "its hello")
        except JobError:
          peer.close()
          continue
        index, count = hello.get("hello"), hello.get("count")
        if "fail" in hello and isinstance(index, int):  # it failed before joining: a bad input of its own
          message = f"process {index}: {str(hello['fail'])[:500]}"
          peer.close()
          self._peers = list(waiting.values())
          self.fail(message)
          raise JobError(message)
        if count != self.count or not isinstance(index, int) or not 0 < index < self.count or index in waiting:
          what = (f"--num-processes {count}" if count != self.count else f"--process-id {index}")
          message = (f"a process joined with {what}, which does not fit this job (--num-processes {self.count}, "
                     f"process ids 0 to {self.count - 1} once each)")
          peer.send({"fail": message})
          peer.close()
          self._peers = list(waiting.values())
          self.fail(message)
          raise JobError(message)
        peer.name = f"process {index}"
        waiting[index] = peer
      self._peers = [waiting[i] for i in sorted(waiting)]
      for peer in self._peers:
        peer.send({"joined": self.count})
    finally:
      server.close()

  def _connect(self, host: str, port: int) -> None:
    start = time.monotonic()
    deadline, refused_since = start + self.timeout, None
    reason = "no answer"
    while True:
      now = time.monotonic()
      left = deadline - now
      if refused_since is not None and now - refused_since >= self.refused_s:
        raise JobError(f"nobody listens at the coordinator {host}:{port} (connection refused for "
                       f"{now - start:.0f} s); is process 0 running there? Start it, or give --timeout to wait longer")
      if left <= 0:
        raise JobError(f"cannot reach the coordinator {host}:{port} within {self.timeout:g} s ({reason}); is "
                       "process 0 running there? (see --timeout)")
      try:
        sock = socket.create_connection((host, port), timeout=min(left, 5.0))
        break
      except OSError as e:
        reason = e.strerror or type(e).__name__
        refused = isinstance(e, ConnectionRefusedError)
        refused_since = (refused_since or now) if refused else None
        time.sleep(min(0.2, max(left, 0)))
    peer = _Peer(sock, "process 0")
    peer.send({"hello": self.index, "count": self.count})
    self._peers = [peer]
    reply = peer.recv(self.timeout + 10.0, "every process to join")  # process 0 says first why not
    if "fail" in reply:
      raise JobError(f"process {reply.get('from', 0)}: {reply['fail']}")

  def _heartbeat(self) -> None:
    period = max(0.2, min(5.0, self.timeout / 4))
    while not self._closed.wait(period):
      for peer in list(self._peers):
        try:
          peer.beat()
        except OSError:
          pass

  def exchange(self, tag: str, text: str) -> list[str]:
    """Every process's `text` for the step `tag`, in process order (every process calls this, in the same order)."""
    waiting_for = f"every process to reach {tag!r}"
    if self.index != 0:
      peer = self._peers[0]
      try:
        peer.send({"tag": tag, "text": text})
      except OSError:
        pass  # process 0 has gone or failed: its last message (or the closed connection) says which
      reply = peer.recv(self.timeout, waiting_for)
      if "fail" in reply:
        raise JobError(f"process {reply.get('from', 0)}: {reply['fail']}")
      return list(reply["texts"])
    texts = [text]
    for peer in self._peers:
      try:
        message = peer.recv(self.timeout, waiting_for)
      except JobError as e:
        self.fail(str(e))
        raise
      if "fail" in message:
        self.fail(message["fail"], origin=self._peers.index(peer) + 1)
        raise JobError(f"{peer.name}: {message['fail']}")
      if message.get("tag") != tag:
        error = f"{peer.name} reached {message.get('tag')!r} where process 0 reached {tag!r}"
        self.fail(error)
        raise JobError(error)
      texts.append(message["text"])
    for peer in self._peers:
      try:
        peer.send({"tag": tag, "texts": texts})
      except OSError:
        pass
    return texts

  def fail(self, message: str, origin: int | None = None) -> None:
    """Tells the other processes (process 0: every one; another: process 0, which relays it) that the job
    failed with `message` (on process `origin`, default this one); best effort, then the connections close."""
    origin = self.index if origin is None else origin
    for peer in self._peers:
      try:
        peer.send({"fail": message, "from": origin})
      except OSError:
        pass
    self.close()

  def close(self) -> None:
    self._closed.set()
    for peer in self._peers:
      peer.close()
