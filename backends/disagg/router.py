"""The `router` model: one client stream, served by a prefill and a decode engine.

Per request it picks a bootstrap room, starts the request on `decode` and on
`prefill` (each child's stream read in a worker thread, so the model's own
thread never blocks), forwards prefill's first token the moment it is sampled,
then each of decode's responses as it arrives. Whichever child fails first ends
the client stream with its error and aborts the other; a client that cancels
aborts both, which frees their KV. Children are local models (BLS) or, for two
hosts, a remote tritonserver over gRPC (`prefill_url` / `decode_url`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import faulthandler
import logging
import random
import signal
import threading
from typing import Iterator

import numpy as np

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
    "prefill_url": "",      # "" = the prefill model of this server (BLS); host:port = a remote tritonserver (gRPC)
    "prefill_model": "prefill",
    "decode_url": "",
    "decode_model": "decode",
    "default_max_tokens": 256,
    "max_threads": 512,
    "token_channel": True,  # a local decode sends its tokens on a unix socket, not as BLS responses
}
# With the token channel, decode's BLS stream ends right after its last frame is written; the
# frame may still be on its way through the channel's reader.
CHANNEL_GRACE_S = 5.0
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
        self.pb, self.model, self.retired = pb, model, retired
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

    def cancel(self, room: int) -> None:
        request = self.pb.InferenceRequest(
            model_name=self.model, requested_output_names=[],
            inputs=[self.pb.Tensor("text_input", np.array([b"-"], dtype=np.object_)),
                    self.pb.Tensor("cancel_room", np.array([room], dtype=np.uint64))])
        responses = request.exec(decoupled=True)
        for _ in responses:
            pass
        self.retired.add(responses)


class RemoteChild:
    """A model on another tritonserver (another host), over gRPC."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def stream(self, tensors: dict[str, np.ndarray]) -> Iterator[tuple[str | None, RequestOutput | None]]:
        from backends.grpc_stream import numpy_inputs, stream_events
        for error, outputs in stream_events(self.url, self.model, numpy_inputs(tensors), timeout_s=600):
            yield error, None if error else child_output(outputs or {})

    def cancel(self, room: int) -> None:
        from backends.grpc_stream import numpy_inputs, stream_events
        inputs = numpy_inputs({"text_input": np.array([b"-"], dtype=np.object_),
                               "cancel_room": np.array([room], dtype=np.uint64)})
        for _ in stream_events(self.url, self.model, inputs, timeout_s=30):
            pass


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
        refuse_unknown(params, PARAMETERS, args.get("model_name", "router"))
        get = lambda key: typed_parameter(key, params[key], PARAMETERS[key]) if params.get(key, "").strip() \
            else PARAMETERS[key]
        self.retired = Retired()
        self.relays: dict[int, Relay] = {}
        self.lock = threading.Lock()
        self.prefill = self._child(get("prefill_url"), get("prefill_model"))
        channel = get("token_channel") and not get("decode_url")
        self.decode = self._child(get("decode_url"), get("decode_model"), channel)
        self.listener = Listener(process_identity(), self._from_channel) if channel else None
        self.default_max_tokens = get("default_max_tokens")
        self.threads = concurrent.futures.ThreadPoolExecutor(get("max_threads"), thread_name_prefix="tandem-router")
        self.latencies = LatencyMetrics(self.pb, args.get("model_name", "router"))
        self._start_watcher()

    def _child(self, url: str, model: str, channel: bool = False):
        return RemoteChild(url, model) if url else LocalChild(self.pb, model, self.retired, channel)

    def _from_channel(self, batch: list[tuple[int, RequestOutput]]) -> None:
        """The frames that came together from one decode process: each relay's in order, the
        relays' sends at once (a send waits for the server), all done before the next batch."""
        by_room: dict[int, list[RequestOutput]] = collections.defaultdict(list)
        for room, out in batch:
            by_room[room].append(out)
        with self.lock:
            jobs = [(relay, outs) for room, outs in by_room.items() if (relay := self.relays.get(room))]
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
        relay = Relay(room, ResponseStream(self.pb, sender, parsed, wanted, lambda _id: self._abort(room),
                                           self.latencies))
        with self.lock:
            self.relays[room] = relay
        child_inputs = {**inputs, "stream": np.array([True]), "exclude_input_in_output": np.array([True]),
                        "bootstrap_room": np.array([room], dtype=np.uint64),
                        # the children's logprobs (any convention) come back as the vLLM backend's JSON
                        "return_logprobs": np.array([parsed.params.logprobs is not None])}
        self.threads.submit(self._run, relay, self.decode, child_inputs, True)
        self.threads.submit(self._run, relay, self.prefill, child_inputs, False)

    def _run(self, relay: Relay, child, inputs: dict, is_decode: bool) -> None:
        """Reads one child's stream to its end (see Retired), whatever the relay does with it."""
        name, other = ("decode", self.prefill) if is_decode else ("prefill", self.decode)
        try:
            for error, out in child.stream(inputs):
                if error:
                    self._child_failed(relay, f"{name}: {error}", other)
                elif is_decode:
                    relay.from_decode(out)
                else:
                    relay.from_prefill(out)
            if is_decode:  # a no-op after decode's last output (the relay is done)
                if self.listener is not None:
                    relay.ended.wait(CHANNEL_GRACE_S)
                self._child_failed(relay, "decode ended its stream without a finish reason", other)
        except Exception as exc:
            log.exception("room %d: %s stream failed", relay.room, name)
            relay.fail(f"{name} failed: {exc}")
            self._abort(relay.room)
        finally:
            if is_decode:
                with self.lock:
                    self.relays.pop(relay.room, None)

    def _child_failed(self, relay: Relay, message: str, other) -> None:
        if relay.fail(message):
            self._cancel(other, relay.room)

    def _abort(self, room: int) -> None:
        with self.lock:
            relay = self.relays.get(room)
        if relay is None or relay.cancelled:
            return
        relay.cancelled = True
        for child in (self.decode, self.prefill):
            self.threads.submit(self._cancel, child, room)

    def _cancel(self, child, room: int) -> None:
        try:
            child.cancel(room)
        except Exception as exc:
            log.warning("could not cancel room %d on %s: %s", room, child.model, exc)

    def poll(self) -> None:
        self.latencies.flush()
        retired = self.retired.take()
        asked = False
        with self.lock:
            relays = list(self.relays.values())
        for relay in relays:
            if relay.client.cancelled():
                self._abort(relay.room)
            elif not relay.done:  # its stream was open all along, so the query reached the server
                asked = True
        if not asked:
            self.retired.put_back(retired)  # until a query goes out after them

    def close(self) -> None:
        # Nothing may call into the stub after finalize: relays send nothing more, and
        # children not started yet never start (running ones end with their child).
        with self.lock:
            relays = list(self.relays.values())
        for relay in relays:
            relay.shut()
        if self.listener is not None:
            self.listener.close()
        self.threads.shutdown(wait=False, cancel_futures=True)
