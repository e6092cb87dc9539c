"""decode -> router on one tritonserver: each output as a frame on a unix socket, not a BLS response.

Through BLS each token passes through the server process between the two stubs (two
shared-memory messages, three processes woken); on a 2-core machine those wake-ups land
inside the engines' forwards, and at 16 streams the relay cost `router` a fifth of its
throughput. The router listens on an abstract unix socket named after its process identity;
a decode request that carries PARAMETER writes its outputs there, and its BLS stream carries
only its end, or an error (errors never travel as frames). Frames are JSON: a peer could be
any local process of the same user, so nothing is unpickled.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from typing import Callable

from backends.request import RequestOutput

log = logging.getLogger("tandem.channel")
# The request parameter a router sets on its decode requests: send the outputs to my channel.
PARAMETER = "tandem_token_channel"
HEADER = struct.Struct("<I")
# A router that stops reading fills the socket's buffer; a send waits this long, then fails.
SEND_TIMEOUT_S = 30.0


def address(identity: str) -> str:
    """The router's socket, in the abstract namespace (no file to clean up after a crash)."""
    return f"\0tandem-tokens-{identity}"


def encode(room: int, out: RequestOutput) -> bytes:
    logprobs = None if out.logprobs is None else [list(entry.items()) for entry in out.logprobs]
    body = json.dumps([room, out.text, out.token_ids, out.finished, out.finish_reason,
                       out.num_prompt_tokens, out.num_output_tokens, logprobs]).encode()
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> tuple[int, RequestOutput]:
    room, text, ids, finished, reason, n_in, n_out, logprobs = json.loads(body)
    if logprobs is not None:  # (id, (logprob, rank, text)) pairs, so the ids stay ints
        logprobs = [{tid: tuple(value) for tid, value in entry} for entry in logprobs]
    return room, RequestOutput(str(room), text, ids, finished, reason, None, n_in, n_out, logprobs=logprobs)


class Writer:
    """decode's end: one connection to one router, shared by the send threads."""

    def __init__(self, identity: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(SEND_TIMEOUT_S)
        try:
            self.sock.connect(address(identity))
        except OSError:
            self.sock.close()
            raise
        self.lock = threading.Lock()
        self.broken = False

    def send(self, room: int, out: RequestOutput) -> None:
        frame = encode(room, out)
        with self.lock:
            if self.broken:
                raise ConnectionError("the token channel to the router is closed")
            try:
                self.sock.sendall(frame)
            except OSError:
                self.broken = True   # a frame may be cut: nothing more may follow it
                raise

    def close(self) -> None:
        self.broken = True
        self.sock.close()


class Writers:
    """decode's connections, one per router process, opened on first use."""

    def __init__(self):
        self.lock = threading.Lock()
        self.writers: dict[str, Writer] = {}

    def get(self, identity: str) -> Writer | None:
        """The open channel to that router; None if it cannot be reached (use BLS)."""
        with self.lock:
            writer = self.writers.get(identity)
            if writer is not None and not writer.broken:
                return writer
            try:
                writer = self.writers[identity] = Writer(identity)
            except OSError as exc:
                log.warning("no token channel to router %s (%s): its outputs go over BLS", identity, exc)
                self.writers.pop(identity, None)
                return None
            return writer

    def close(self) -> None:
        with self.lock:
            writers, self.writers = list(self.writers.values()), {}
        for writer in writers:
            writer.close()


class Listener:
    """The router's end: accepts decode processes (same user only) and hands each batch of
    frames that arrived together to `deliver`, in order, from one thread per connection."""

    def __init__(self, identity: str, deliver: Callable[[list[tuple[int, RequestOutput]]], None]):
        self.deliver = deliver
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address(identity))
        self.sock.listen(16)
        self.conns: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, name="tandem-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._same_user(conn):
                conn.close()
                continue
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), name="tandem-channel-read", daemon=True).start()

    @staticmethod
    def _same_user(conn: socket.socket) -> bool:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            log.warning("token channel: refused a connection from uid %d", uid)
        return uid == os.getuid()

    def _read(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while not self.closed:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return  # that decode process closed it or died; its BLS streams end too
                buffer += data
                try:
                    batch, buffer = self._frames(buffer)
                except ValueError as exc:  # not a frame of ours: drop that peer
                    log.error("token channel: a bad frame (%s); closing that connection", exc)
                    return
                try:
                    if batch:
                        self.deliver(batch)
                except Exception:  # one relay's failure must not stop the others' tokens
                    log.exception("token channel: delivering a batch failed")

    @staticmethod
    def _frames(buffer: bytes) -> tuple[list[tuple[int, RequestOutput]], bytes]:
        batch, at = [], 0
        while len(buffer) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, at)
            if len(buffer) - at - HEADER.size < size:
                break
            batch.append(decode(buffer[at + HEADER.size:at + HEADER.size + size]))
            at += HEADER.size + size
        return batch, buffer[at:]

    def close(self) -> None:
        self.closed = True
        for s in [self.sock, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
