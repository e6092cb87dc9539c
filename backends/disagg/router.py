"""The `router` model: one client stream, served by a prefill and a decode engine.

Per request it picks a prefill and a decode endpoint (backends.disagg.endpoints: local
models over BLS or remote tritonservers over gRPC, chosen by policy among those in the
rotation) and a bootstrap room, starts the request on both (decode told which prefill
agent writes its KV; each child's stream read in a worker thread, so the model's own
thread never blocks), forwards prefill's first token the moment it is sampled, then each
of decode's responses as it arrives. Whichever child fails first ends the attempt: before
any token reached the client, the router checks both endpoints and, when one of them
fails its check, tries once more on another pair (same client stream, new room);
otherwise the client stream ends with the error and the other child is aborted. A client
that cancels aborts both, which frees their KV.
"""
from __future__ import annotations

import collections
import concurrent.futures
import faulthandler
import logging
import json
import random
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from backends.disagg.endpoints import Endpoint, Endpoints, RoutingConfig, parse_endpoints, prefix_chain
from backends.parameters import refuse_unknown, typed_parameter
from backends.request import InvalidRequest, RequestOutput
from backends.token_channel import PARAMETER as CHANNEL_PARAMETER
from backends.token_channel import Listener
from backends.triton_stream import (PARENT_PARAMETER, LatencyMetrics, ResponseStream, StreamingModel, model_parameters,
                                    process_identity)
from backends.triton_io import parse_request, parse_vllm_logprobs

log = logging.getLogger("tandem.router")
# The router's config.pbtxt parameters and their defaults.
PARAMETERS = {
    "prefill_endpoints": "",  # comma-separated `local` / host:port (gRPC) entries; "" = prefill_url alone
    "decode_endpoints": "",
    "prefill_url": "",      # shorthand for one endpoint: "" = the prefill model of this server (BLS), host:port = remote
    "prefill_model": "prefill",
    "decode_url": "",
    "decode_model": "decode",
    "prefill_policy": "cache_aware",
    "decode_policy": "least_load",
    "health_interval_s": 2.0,
    "unhealthy_after": 3,
    "healthy_after": 2,
    "cache_threshold": 0.3,
    "balance_abs_threshold": 16,
    "balance_rel_threshold": 1.5,
    "default_max_tokens": 256,
    "max_threads": 512,
    "token_channel": True,  # a local decode sends its tokens on a unix socket, not as BLS responses
}
# With the token channel, decode's BLS stream ends right after its last frame is written; the
# frame may still be on its way through the channel's reader.
CHANNEL_GRACE_S = 5.0
DESCRIBE_TIMEOUT_S = 5.0
# How long finalize waits for a check in flight (a server stops within 5 s of a SIGTERM; a
# local model being unloaded answers a describe at once, with an error).
STOP_WAIT_S = 2.0
CHILD_OUTPUTS = ["text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens", "logprobs",
                 "num_cached_tokens"]


class Retired:
    """BLS response iterators whose stream has ended, kept until the stub has let go of them.

    The stub (Triton 2.51) keeps every decoupled BLS response iterator in a map until a
    background thread has sent the server its cleanup message, queued by the last
    response. When Python has dropped its own reference by then, that thread destroys the
    iterator, and with it every response's numpy arrays, without holding the GIL: pymalloc
    and reference counts get corrupted ("Reference count error detected ... dtype 17 (O)",
    "malloc(): unaligned fastbin chunk detected") and the stub crashes later. That thread
    sends its messages in order, is_cancelled() queries included, so an iterator retired
    before a query that went out and came back is no longer in the map: dropping it then
    frees it here, under the GIL."""

    def __init__(self):
        self.lock = threading.Lock()
        self.iterators: list = []

    def add(self, iterator) -> None:
        with self.lock:
            self.iterators.append(iterator)

    def take(self) -> list:
        with self.lock:
            taken, self.iterators = self.iterators, []
        return taken

    def put_back(self, iterators: list) -> None:
        with self.lock:
            self.iterators.extend(iterators)


class LocalChild:
    """A model in the same tritonserver, called with BLS."""

    def __init__(self, pb, model: str, retired: Retired, channel: bool = False):
        self.pb, self.model, self.retired, self.channel = pb, model, retired, channel
        self.parameters = {PARENT_PARAMETER: process_identity()}  # the child aborts if this process dies
        if channel:
            self.parameters[CHANNEL_PARAMETER] = "1"

    def stream(self, tensors: dict[str, np.ndarray]) -> Iterator[tuple[str | None, RequestOutput]]:
        """(error, outputs) per response, until the child's final one."""
        request = self.pb.InferenceRequest(
            model_name=self.model, requested_output_names=CHILD_OUTPUTS, parameters=self.parameters,
            inputs=[self.pb.Tensor(name, array) for name, array in tensors.items()])
        responses = request.exec(decoupled=True)
        try:
            for response in responses:
                if response.has_error():
                    yield response.error().message(), None
                else:
                    yield None, child_output({t.name(): t.as_numpy() for t in response.output_tensors()})
        finally:
            self.retired.add(responses)

    def describe(self) -> dict:
        request = self.pb.InferenceRequest(
            model_name=self.model, requested_output_names=["text_output"], inputs=[
                self.pb.Tensor("text_input", np.array([b"-"], dtype=np.object_)),
                self.pb.Tensor("describe", np.array([True]))])
        responses = request.exec(decoupled=True)
        answers, errors = [], []
        try:   # read to its end, an error included: the iterator is retired only then (Retired)
            for response in responses:
                if response.has_error():
                    errors.append(response.error().message())
                else:
                    answers += [t.as_numpy() for t in response.output_tensors() if t.name() == "text_output"]
        finally:
            self.retired.add(responses)
        if errors:
            raise RuntimeError(errors[0])
        return describe_answer(answers)

    def cancel(self, room: int) -> None:
        request = self.pb.InferenceRequest(
            model_name=self.model, requested_output_names=[],
            inputs=[self.pb.Tensor("text_input", np.array([b"-"], dtype=np.object_)),
                    self.pb.Tensor("cancel_room", np.array([room], dtype=np.uint64))])
        responses = request.exec(decoupled=True)
        try:
            for _ in responses:
                pass
        finally:
            self.retired.add(responses)


class RemoteChild:
    """A model on another tritonserver (another host), over gRPC."""

    channel = False   # a remote decode streams its tokens over gRPC

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def stream(self, tensors: dict[str, np.ndarray]) -> Iterator[tuple[str | None, RequestOutput | None]]:
        from backends.grpc_stream import numpy_inputs, stream_events
        for error, outputs in stream_events(self.url, self.model, numpy_inputs(tensors), timeout_s=600):
            yield error, None if error else child_output(outputs or {})

    def describe(self) -> dict:
        from backends.grpc_stream import numpy_inputs, stream_events
        inputs = numpy_inputs({"text_input": np.array([b"-"], dtype=np.object_), "describe": np.array([True])})
        answers = []
        for error, outputs in stream_events(self.url, self.model, inputs, timeout_s=DESCRIBE_TIMEOUT_S):
            if error:
                raise RuntimeError(error)
            answers.append(outputs.get("text_output"))
        return describe_answer(answers)

    def cancel(self, room: int) -> None:
        from backends.grpc_stream import numpy_inputs, stream_events
        inputs = numpy_inputs({"text_input": np.array([b"-"], dtype=np.object_),
                               "cancel_room": np.array([room], dtype=np.uint64)})
        for _ in stream_events(self.url, self.model, inputs, timeout_s=30):
            pass


def describe_answer(answers: list) -> dict:
    texts = [_str({"t": a}, "t") for a in answers if a is not None]
    if not texts:
        raise RuntimeError("no answer to describe")
    return json.loads(texts[0])


@dataclass(eq=False)
class Attempt:
    """One try at a request: its room on one prefill and one decode endpoint."""

    room: int
    prefill: Endpoint
    decode: Endpoint
    tokens: int           # the decode endpoint's load it stands for (max_tokens)
    inputs: dict
    ended: bool = False   # a child failed (or the relay finished): nothing more is decided for it


class Relay:
    """Merges the two children's streams into the client's, each token once: decode's
    responses carry its output tokens from the first one on, and the ones prefill
    already forwarded are cut by their position."""

    def __init__(self, room: int, client: ResponseStream):
        self.room, self.client = room, client
        self.lock = threading.Lock()
        self.forwarded = 0      # output tokens already sent to the client
        self.prefill_text = ""  # the text of the tokens prefill forwarded
        self.echoed = 0         # how much of it decode has sent again
        self.decoded = 0        # output tokens decode has sent
        self.cached = 0         # prompt tokens prefill took from its prefix cache (prefill's outputs say)
        self.ended = threading.Event()  # the final response is sent (or no more may be)
        self.cancelled = False
        self.attempt: Attempt | None = None   # the current one
        self.retried = False

    @property
    def done(self) -> bool:
        return self.ended.is_set()

    def from_prefill(self, out: RequestOutput) -> None:
        ids, text = out.token_ids, out.text
        with self.lock:
            self.cached = max(self.cached, out.num_cached_tokens)
            if self.done or self.forwarded or not ids or not text:
                return  # decode got there first, or the first token is not a whole character yet
            self.forwarded, self.prefill_text = len(ids), text
            self._send(RequestOutput(str(self.room), text, ids, num_prompt_tokens=out.num_prompt_tokens,
                                     num_output_tokens=len(ids), logprobs=out.logprobs,
                                     num_cached_tokens=self.cached))

    def from_decode(self, out: RequestOutput) -> None:
        """Forwards one decode output at once; the one with a finish reason is the last."""
        ids, text, reason, logprobs = out.token_ids, out.text, out.finish_reason, out.logprobs
        final = bool(reason)
        with self.lock:
            start, self.decoded = self.decoded, self.decoded + len(ids)
            if self.done:
                return
            if start < self.forwarded:  # prefill already streamed these tokens: cut them and their text
                ids = ids[self.forwarded - start:]
                logprobs = None if logprobs is None else logprobs[self.forwarded - start:]
                text = self._cut_prefill_text(text)
            if not (ids or text or final):
                return
            self.forwarded = max(self.forwarded, self.decoded)
            if final:
                self.ended.set()
            self._send(RequestOutput(str(self.room), text, ids, finished=final, finish_reason=reason or None,
                                     num_prompt_tokens=out.num_prompt_tokens,
                                     num_output_tokens=out.num_output_tokens, logprobs=logprobs,
                                     num_cached_tokens=self.cached))

    def _cut_prefill_text(self, text: str) -> str:
        """Decode's text past what prefill already sent (both detokenize the same tokens alike)."""
        left = self.prefill_text[self.echoed:]
        cut = min(len(left), len(text))
        if text[:cut] != left[:cut]:
            log.warning("room %d: decode's text %r differs from prefill's %r", self.room, text, left)
        self.echoed += cut
        return text[cut:]

    def fail(self, message: str) -> bool:
        with self.lock:
            if self.done:
                return False
            self.ended.set()
            self._send(RequestOutput(str(self.room), finished=True, finish_reason="error", error=message))
            return True

    def shut(self) -> None:
        """Sends nothing more (the model is being finalized)."""
        with self.lock:
            self.ended.set()

    def _send(self, out: RequestOutput) -> None:
        self.client(out)


def child_output(outputs: dict) -> RequestOutput:
    """A child's response tensors as the output they stand for (room left blank)."""
    ids = [int(t) for t in np.asarray(outputs.get("output_ids", [])).reshape(-1)]
    logprobs = parse_vllm_logprobs(_str(outputs, "logprobs")) if _str(outputs, "logprobs") else None
    return RequestOutput("", _str(outputs, "text_output"), ids, finish_reason=_str(outputs, "finish_reason") or None,
                         num_prompt_tokens=_int(outputs, "num_input_tokens"),
                         num_output_tokens=_int(outputs, "num_output_tokens"), logprobs=logprobs,
                         num_cached_tokens=_int(outputs, "num_cached_tokens"))


def _str(outputs: dict, name: str) -> str:
    value = outputs.get(name)
    if value is None or np.asarray(value).size == 0:
        return ""
    item = np.asarray(value).reshape(-1)[0]
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def _int(outputs: dict, name: str) -> int:
    value = outputs.get(name)
    return int(np.asarray(value).reshape(-1)[0]) if value is not None and np.asarray(value).size else 0


class RouterModel(StreamingModel):

    def initialize(self, args: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        # Triton does not restart a stub that crashes: leave every thread's Python stack in its log.
        faulthandler.enable()
        faulthandler.register(signal.SIGUSR1, all_threads=True)   # see EngineModel.initialize
        params = model_parameters(args)
        name = args.get("model_name", "router")
        refuse_unknown(params, PARAMETERS, name)
        get = lambda key: typed_parameter(key, params[key], PARAMETERS[key]) if params.get(key, "").strip() \
            else PARAMETERS[key]
        self.retired = Retired()
        self.relays: dict[int, Relay] = {}   # by the room of their current attempt
        self.lock = threading.Lock()
        routing = RoutingConfig(**{key: get(key) for key in RoutingConfig.__dataclass_fields__})
        channel = get("token_channel")
        self.endpoints = Endpoints(self._endpoints(get, "prefill"), self._endpoints(get, "decode", channel),
                                   routing, lambda ep: ep.child.describe())
        uses_channel = any(ep.child.channel for ep in self.endpoints.decode)
        self.listener = Listener(process_identity(), self._from_channel) if uses_channel else None
        self.default_max_tokens = get("default_max_tokens")
        self.threads = concurrent.futures.ThreadPoolExecutor(get("max_threads"), thread_name_prefix="tandem-router")
        self.latencies = LatencyMetrics(self.pb, name)
        self.metrics = EndpointMetrics(self.pb, name, self.endpoints.all)
        self.health = HealthChecker(self.endpoints)
        self._start_watcher()

    def _endpoints(self, get, kind: str, channel: bool = False) -> list[Endpoint]:
        """prefill_endpoints / decode_endpoints; when empty, prefill_url / decode_url ("" = local)."""
        listed = get(f"{kind}_endpoints").strip() or get(f"{kind}_url").strip() or "local"
        model = get(f"{kind}_model")
        return [Endpoint(kind, entry, self._child(entry, model, channel))
                for entry in parse_endpoints(listed, f"{kind}_endpoints")]

    def _child(self, entry: str, model: str, channel: bool = False):
        return LocalChild(self.pb, model, self.retired, channel) if entry == "local" else RemoteChild(entry, model)

    def _from_channel(self, batch: list[tuple[int, RequestOutput]]) -> None:
        """The frames that came together from one decode process: each relay's in order, the
        relays' sends at once (a send waits for the server), all done before the next batch."""
        by_room: dict[int, list[RequestOutput]] = collections.defaultdict(list)
        for room, out in batch:
            by_room[room].append(out)
        with self.lock:
            # a failed attempt's frames (its abort, once cancelled) go nowhere
            jobs = [(relay, outs) for room, outs in by_room.items()
                    if (relay := self.relays.get(room)) and not relay.attempt.ended]
        def forward(relay: Relay, outs: list[RequestOutput]) -> None:
            for out in outs:
                relay.from_decode(out)
        if len(jobs) == 1:
            return forward(*jobs[0])
        for future in [self.threads.submit(forward, *job) for job in jobs]:
            if (exc := future.exception()) is not None:
                log.error("forwarding decode's tokens failed: %r", exc)

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        # Copies: the numbers' arrays are views of the request's shared memory, which the
        # server frees once execute returns, before the worker threads read them.
        inputs = {t.name(): t.as_numpy().copy() for t in request.inputs()}
        try:
            parsed = parse_request(inputs.get, self.default_max_tokens)
        except InvalidRequest as exc:
            self._reject(sender, str(exc))
            return
        room = random.getrandbits(62) + 1
        wanted = parsed.wanted(tuple(request.requested_output_names()))
        relay = Relay(room, ResponseStream(self.pb, sender, parsed, wanted, lambda _id: self._abort(relay),
                                           self.latencies))
        child_inputs = {**inputs, "stream": np.array([True]), "exclude_input_in_output": np.array([True]),
                        # the children's logprobs (any convention) come back as the vLLM backend's JSON
                        "return_logprobs": np.array([parsed.params.logprobs is not None])}
        chain = prefix_chain(parsed.prompt, (b"chat:" if parsed.chat else b"raw:") + (parsed.cache_salt or b""))
        problem = self._launch(relay, child_inputs, chain, parsed.params.max_tokens, room)
        if problem:
            relay.fail(problem)

    def _launch(self, relay: Relay, inputs: dict, chain: list[bytes], max_tokens: int, room: int,
                avoid: tuple[Endpoint, ...] = ()) -> str | None:
        """Start an attempt on a prefill and a decode endpoint; the reason if none can be had."""
        pair = self._pair(chain, avoid)
        if isinstance(pair, str):
            return pair
        prefill, decode = pair
        agent = f"{prefill.identity['agent']}@{prefill.nixl_host(decode)}:{prefill.identity['nixl_port']}"
        attempt = Attempt(room, prefill, decode, max_tokens, {
            **inputs, "bootstrap_room": np.array([room], dtype=np.uint64)})
        with self.lock:
            if relay.attempt is not None:
                self.relays.pop(relay.attempt.room, None)
            relay.attempt = attempt
            self.relays[room] = relay
        self.endpoints.sent(prefill, chain, 1)
        self.endpoints.sent(decode, chain, max_tokens)
        decode_inputs = {**attempt.inputs, "prefill_agent": np.array([agent.encode()], dtype=np.object_)}
        self.threads.submit(self._run, relay, attempt, True, decode_inputs)
        self.threads.submit(self._run, relay, attempt, False, attempt.inputs)
        return None

    def _pair(self, chain: list[bytes], avoid: tuple[Endpoint, ...]) -> tuple[Endpoint, Endpoint] | str:
        chosen = []
        for kind in ("decode", "prefill"):
            self.health.check_local(kind)
            ep = self.endpoints.choose(kind, chain, avoid)
            if ep is None:
                self.health.check_out(kind)  # never answered yet (the server is starting), or local and out
                ep = self.endpoints.choose(kind, chain, avoid)
            if ep is None:
                down = ", ".join(e.address for e in getattr(self.endpoints, kind))
                return f"no {kind} endpoint is in the rotation (all down: {down})"
            chosen.append(ep)
        decode, prefill = chosen
        return prefill, decode

    def _run(self, relay: Relay, attempt: Attempt, is_decode: bool, inputs: dict) -> None:
        """Reads one child's stream to its end (see Retired), whatever the relay does with it."""
        name, ep = ("decode", attempt.decode) if is_decode else ("prefill", attempt.prefill)
        try:
            for error, out in ep.child.stream(inputs):
                if attempt.ended or attempt is not relay.attempt:
                    continue   # an attempt that failed (or was given up for another): read to its end, forward nothing
                if error:
                    self._attempt_failed(relay, attempt, f"{name}: {error}")
                elif is_decode:
                    relay.from_decode(out)
                else:
                    relay.from_prefill(out)
            if is_decode and not attempt.ended:  # a no-op after decode's last output (the relay is done)
                if ep.child.channel:
                    relay.ended.wait(CHANNEL_GRACE_S)
                self._attempt_failed(relay, attempt, "decode ended its stream without a finish reason")
        except Exception as exc:
            log.exception("room %d: %s stream failed", attempt.room, name)
            self._attempt_failed(relay, attempt, f"{name} failed: {exc}")
        finally:
            self.endpoints.done(ep, attempt.tokens if is_decode else 1)
            if is_decode:
                with self.lock:
                    if self.relays.get(attempt.room) is relay:
                        self.relays.pop(attempt.room)

    def _attempt_failed(self, relay: Relay, attempt: Attempt, message: str) -> None:
        """Before any token reached the client, one more try on another pair when an endpoint of
        this one fails its check; else the error goes to the client and the other child is aborted."""
        with relay.lock:
            if attempt.ended or relay.done:
                return
            attempt.ended = True
            untouched = relay.forwarded == 0 and not relay.retried and not relay.cancelled
        self._cancel_attempt(attempt)
        if untouched:
            bad = tuple(ep for ep in (attempt.prefill, attempt.decode) if not self.endpoints.check(ep))
            if bad:
                relay.retried = True
                log.warning("room %d failed on %s (%s); trying again elsewhere", attempt.room,
                            " and ".join(ep.label for ep in bad), message)
                chain = []  # the retry goes where load says: the prefix memory is for first choices
                problem = self._launch(relay, attempt.inputs, chain, attempt.tokens, random.getrandbits(62) + 1, bad)
                if problem is None:
                    return
                message = f"{message}; {problem}"
        else:   # no retry to decide: the checks count the failure in the background
            for ep in (attempt.prefill, attempt.decode):
                self.threads.submit(self.endpoints.check, ep)
        relay.fail(message)

    def _abort(self, relay: Relay) -> None:
        if relay.cancelled or relay.attempt is None:
            return
        relay.cancelled = True
        self._cancel_attempt(relay.attempt)

    def _cancel_attempt(self, attempt: Attempt) -> None:
        for ep in (attempt.decode, attempt.prefill):
            self.threads.submit(self._cancel, ep, attempt.room)

    def _cancel(self, ep: Endpoint, room: int) -> None:
        try:
            ep.child.cancel(room)
        except Exception as exc:
            log.warning("could not cancel room %d on %s: %s", room, ep.label, exc)

    def poll(self) -> None:
        self.latencies.flush()
        self.metrics.update(self.endpoints.all)
        retired = self.retired.take()
        asked = False
        with self.lock:
            relays = set(self.relays.values())
        for relay in relays:
            if relay.client.cancelled():
                self._abort(relay)
            elif not relay.done:  # its stream was open all along, so the query reached the server
                asked = True
        if not asked:
            self.retired.put_back(retired)  # until a query goes out after them

    def close(self) -> None:
        # Nothing may call into the stub after finalize: relays send nothing more, and
        # children not started yet never start (running ones end with their child).
        self.health.stop()
        with self.lock:
            relays = list(self.relays.values())
        for relay in relays:
            relay.shut()
        if self.listener is not None:
            self.listener.close()
        self.threads.shutdown(wait=False, cancel_futures=True)


class HealthChecker:
    """Checks every remote endpoint every health_interval_s, in a thread of its own. A model in
    this server (`local`) is checked on the request path only (`check_local`, `check_out`, and
    after a failed request), where the server waits for the check before it unloads anything.
    Sent from this thread, a check that went out as the server began to stop was never
    answered, and tritonserver 2.51 crashed unloading the router with it pending (Signal 11 in
    libtriton_python.so); asking the server whether the model is ready instead crashed the
    stub (docs/shutdown.md). While the server was loading the other models, such a check
    crashed it too."""

    def __init__(self, endpoints: Endpoints):
        self.endpoints = endpoints
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tandem-health", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            for ep in self.endpoints.all:
                if self.stopped.is_set():
                    return
                if ep.address != "local":
                    self.endpoints.check(ep)
            if self.stopped.wait(self.endpoints.cfg.health_interval_s):
                return

    def check_local(self, kind: str) -> None:
        """On the request path: a local endpoint out of the rotation is asked again once every
        health_interval_s, as this thread asks a remote one."""
        for ep in getattr(self.endpoints, kind):
            if ep.address == "local" and ep.identity is not None and not ep.healthy and self.endpoints.due(ep):
                self.endpoints.check(ep)

    def check_out(self, kind: str) -> None:
        """On the request path, when no endpoint of a kind is in the rotation: those that never
        answered, and the local ones out of it, are asked who they are (a local one as many
        times in a row as returning takes, at once)."""
        for ep in getattr(self.endpoints, kind):
            if ep.identity is None:
                self.endpoints.check(ep)
            elif ep.address == "local" and not ep.healthy:
                for _ in range(self.endpoints.cfg.healthy_after):
                    if not self.endpoints.check(ep):
                        break

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=STOP_WAIT_S)


class EndpointMetrics:
    """tandem_router_endpoint_healthy (gauge) and tandem_router_requests (counter) per endpoint."""

    def __init__(self, pb, model: str, endpoints: list[Endpoint]):
        self.families = {
            "healthy": pb.MetricFamily(name="tandem_router_endpoint_healthy", kind=pb.MetricFamily.GAUGE,
                                       description="1 while the endpoint is in the router's rotation"),
            "requests": pb.MetricFamily(name="tandem_router_requests", kind=pb.MetricFamily.COUNTER,
                                        description="requests the router sent to the endpoint, retries included"),
        }
        self.metrics = {(key, ep.label): family.Metric(labels={"model": model, "kind": ep.kind,
                                                                "endpoint": ep.address})
                        for key, family in self.families.items() for ep in endpoints}
        self.values: dict[tuple[str, str], float] = {}

    def update(self, endpoints: list[Endpoint]) -> None:
        for ep in endpoints:
            for key, value in (("healthy", float(ep.healthy)),
                               ("requests", float(ep.requests))):
                old = self.values.get((key, ep.label))
                if old != value:
                    metric = self.metrics[(key, ep.label)]
                    metric.increment(value - (old or 0.0)) if key == "requests" else metric.set(value)
                    self.values[(key, ep.label)] = value

    def release(self) -> None:
        self.metrics.clear()
        self.families.clear()
