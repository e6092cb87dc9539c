"""The router's endpoints: where prefill and decode run, whether they are in the rotation,
how loaded they are, and which one a request goes to.

An endpoint is `local` (the model in this tritonserver, called with BLS) or `host:port` (a
remote tritonserver's gRPC address). Its health comes from a `describe` request (the model
answers its role, and a prefill engine its NIXL agent): every health_interval_s for a remote
one, on the request path for a local one, and at once when a request on it fails: after
`unhealthy_after` failed checks in a row it leaves the rotation, after `healthy_after` good
ones it returns. Load is what the router has in flight there: requests on a prefill
endpoint, tokens still to come on a decode endpoint.

cache_aware (SGLang's router's idea, on text rather than tokens: the router does not
tokenize): each prefill endpoint remembers the prompt prefixes sent to it, as a hash chain
over fixed-size pieces of the text, so the endpoint that most likely holds a prompt's
prefix in its KV cache is found by walking the chain. It wins unless load is out of
balance, or less than cache_threshold of the prompt matches anywhere (then the least
loaded endpoint takes it, and the one that remembers least on a tie, so that new
prefixes spread).
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("tandem.router")
PIECE_CHARS = 64             # the text is matched in pieces of this many characters (about 16 tokens)
REMEMBERED_PIECES = 100_000  # per prefill endpoint, least recently sent forgotten first
PREFILL_POLICIES = ("cache_aware", "least_load", "round_robin")
DECODE_POLICIES = ("least_load", "round_robin")


def parse_endpoints(text: str, parameter: str) -> list[str]:
    """`local` and host:port entries, comma-separated; ValueError names the bad one."""
    entries = [entry.strip() for entry in text.split(",")]
    for i, entry in enumerate(entries, 1):
        if not entry:
            raise ValueError(f"{parameter}: entry {i} of {text!r} is empty")
        if entry != "local":
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{parameter}: {entry!r} is neither `local` nor host:port")
    if len(set(entries)) != len(entries):
        raise ValueError(f"{parameter}: {text!r} names an endpoint twice")
    return entries


def address_towards(host: str) -> str:
    """This machine's address as `host` sees it (the route's source address; no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


@dataclass(frozen=True)
class RoutingConfig:
    prefill_policy: str = "cache_aware"
    decode_policy: str = "least_load"
    health_interval_s: float = 2.0
    unhealthy_after: int = 3
    healthy_after: int = 2
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5

    def __post_init__(self):
        problems = [f"{name} must be {rule}, got {getattr(self, name)!r}" for name, rule, ok in (
            ("prefill_policy", " or ".join(PREFILL_POLICIES), self.prefill_policy in PREFILL_POLICIES),
            ("decode_policy", " or ".join(DECODE_POLICIES), self.decode_policy in DECODE_POLICIES),
            ("health_interval_s", "> 0", self.health_interval_s > 0),
            ("unhealthy_after", ">= 1", self.unhealthy_after >= 1),
            ("healthy_after", ">= 1", self.healthy_after >= 1),
            ("cache_threshold", "in [0, 1]", 0 <= self.cache_threshold <= 1),
            ("balance_abs_threshold", ">= 0", self.balance_abs_threshold >= 0),
            ("balance_rel_threshold", ">= 1", self.balance_rel_threshold >= 1),
        ) if not ok]
        if problems:
            raise ValueError("; ".join(problems))


def prefix_chain(text: str, salt: bytes | None = None) -> list[bytes]:
    """One hash per whole piece of the text, each over the one before it (salted, as the KV cache is)."""
    digest, chain = hashlib.blake2b(salt or b"", digest_size=16).digest(), []
    data = text.encode("utf-8", "surrogatepass")
    for start in range(0, len(data) - PIECE_CHARS + 1, PIECE_CHARS):
        digest = hashlib.blake2b(digest + data[start:start + PIECE_CHARS], digest_size=16).digest()
        chain.append(digest)
    return chain


class PrefixMemory:
    """The prefixes sent to one endpoint (an LRU of chain hashes)."""

    def __init__(self, capacity: int = REMEMBERED_PIECES):
        self.capacity = capacity
        self.pieces: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def matched(self, chain: list[bytes]) -> int:
        """How many leading pieces of the chain were sent here."""
        return next((i for i, piece in enumerate(chain) if piece not in self.pieces), len(chain))

    def remember(self, chain: list[bytes]) -> None:
        for piece in chain:
            self.pieces[piece] = None
            self.pieces.move_to_end(piece)
        while len(self.pieces) > self.capacity:
            self.pieces.popitem(last=False)

    def __len__(self) -> int:
        return len(self.pieces)


@dataclass(eq=False)
class Endpoint:
    kind: str                 # prefill | decode
    address: str              # `local` or host:port
    child: object             # LocalChild / RemoteChild (backends.disagg.router)
    healthy: bool = False     # in the rotation (from its first good check on)
    failures: int = 0         # failed checks in a row
    successes: int = 0        # good checks in a row
    identity: dict | None = None   # what its model said it is (its last good check)
    load: int = 0             # requests (prefill) or their max_tokens (decode) in flight here
    requests: int = 0         # requests sent here, retries included
    asked_at: float = float("-inf")   # time.monotonic() of the last check begun (`due`)
    memory: PrefixMemory = field(default_factory=PrefixMemory)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.address}"

    def nixl_host(self, decode: "Endpoint") -> str:
        """The host a decode endpoint reaches this prefill endpoint's NIXL agent at."""
        if self.address != "local":
            return self.address.rpartition(":")[0]
        return "127.0.0.1" if decode.address == "local" else address_towards(decode.address.rpartition(":")[0])


class Endpoints:
    """Both kinds' endpoints, their health and load; one lock over all of it."""

    def __init__(self, prefill: list[Endpoint], decode: list[Endpoint], cfg: RoutingConfig,
                 describe: Callable[[Endpoint], dict]):
        self.prefill, self.decode, self.cfg, self.describe = prefill, decode, cfg, describe
        self.lock = threading.Lock()
        self.turns = {"prefill": itertools.count(), "decode": itertools.count()}

    @property
    def all(self) -> list[Endpoint]:
        return self.prefill + self.decode

    # ---- health --------------------------------------------------------------------
    def check(self, ep: Endpoint) -> bool:
        """Ask the endpoint who it is; the answer counts toward its health. True if it answered right."""
        try:
            identity = self.describe(ep)
            if identity.get("role") != ep.kind:
                raise RuntimeError(f"it answers as {identity.get('role')!r}, not {ep.kind}")
            if ep.kind == "prefill" and not identity.get("agent"):
                raise RuntimeError("it names no NIXL agent (a prefill endpoint runs dp_size 1)")
        except Exception as exc:
            self._record(ep, False, str(exc))
            return False
        self._record(ep, True, "", identity)
        return True

    def due(self, ep: Endpoint) -> bool:
        """Whether the endpoint's next check is due (health_interval_s since the last one began);
        True claims it, so that of several threads asking at once one checks."""
        with self.lock:
            now = time.monotonic()
            if now - ep.asked_at < self.cfg.health_interval_s:
                return False
            ep.asked_at = now
            return True

    def _record(self, ep: Endpoint, ok: bool, detail: str, identity: dict | None = None) -> None:
        with self.lock:
            if ok:
                first = ep.identity is None
                ep.identity, ep.failures, ep.successes = identity, 0, ep.successes + 1
                if first:
                    ep.healthy = True
                    log.info("router: %s joined the rotation (%s)", ep.label, identity)
                elif not ep.healthy and ep.successes >= self.cfg.healthy_after:
                    ep.healthy = True
                    log.warning("router: %s rejoined the rotation (%d good checks in a row)", ep.label, ep.successes)
            else:
                ep.failures, ep.successes = ep.failures + 1, 0
                if ep.healthy and ep.failures >= self.cfg.unhealthy_after:
                    ep.healthy = False
                    log.warning("router: %s left the rotation (%d failed checks in a row, last: %s)",
                                ep.label, ep.failures, detail)

    # ---- choice --------------------------------------------------------------------
    def choose(self, kind: str, chain: list[bytes], avoid: tuple[Endpoint, ...] = ()) -> Endpoint | None:
        """The endpoint of this kind for a request (None: none in the rotation)."""
        with self.lock:
            candidates = [ep for ep in getattr(self, kind) if ep.healthy and ep not in avoid]
            if not candidates:
                return None
            policy = self.cfg.prefill_policy if kind == "prefill" else self.cfg.decode_policy
            if policy == "round_robin":
                return candidates[next(self.turns[kind]) % len(candidates)]
            if policy == "cache_aware":
                return self._cache_aware(candidates, chain)
            return self._least_loaded(candidates, kind)

    def _least_loaded(self, candidates: list[Endpoint], kind: str) -> Endpoint:
        # ties go round: a burst that finds every endpoint idle must not all go to the first
        start = next(self.turns[kind]) % len(candidates)
        turned = candidates[start:] + candidates[:start]
        return min(turned, key=lambda ep: (ep.load, len(ep.memory)))

    def _cache_aware(self, candidates: list[Endpoint], chain: list[bytes]) -> Endpoint:
        loads = [ep.load for ep in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.cfg.balance_abs_threshold and hi > self.cfg.balance_rel_threshold * lo:
            return self._least_loaded(candidates, "prefill")
        best = max(candidates, key=lambda ep: (ep.memory.matched(chain), -ep.load))
        matched = best.memory.matched(chain)
        if matched and matched >= self.cfg.cache_threshold * len(chain):
            return best
        return self._least_loaded(candidates, "prefill")

    def sent(self, ep: Endpoint, chain: list[bytes], load: int) -> None:
        with self.lock:
            ep.load += load
            ep.requests += 1
            if ep.kind == "prefill":
                ep.memory.remember(chain)

    def done(self, ep: Endpoint, load: int) -> None:
        with self.lock:
            ep.load -= load
