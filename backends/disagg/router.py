"""The `router` model: one client stream, served by a prefill and a decode engine.

Per request it picks a bootstrap room, starts the request on `decode` and on
`prefill` (each child's stream read in a worker thread, so the model's own
thread never blocks), forwards prefill's first token the moment it is sampled,
then decode's stream. Whichever child fails first ends the client stream with
its error and aborts the other; a client that cancels aborts both, which frees
their KV. Children are local models (BLS) or, for two hosts, a remote
tritonserver over gRPC (`prefill_url` / `decode_url`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
from typing import Iterator

import numpy as np

from backends.request import RequestOutput
from backends.triton_adapter import LatencyMetrics, ResponseStream, StreamingModel, model_parameters
from backends.triton_io import OUTPUTS, parse_request
from backends.engine import InvalidRequest

log = logging.getLogger("tandem.router")
CHILD_OUTPUTS = ["text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens"]


class LocalChild:
    """A model in the same tritonserver, called with BLS."""

    def __init__(self, pb, model: str):
        self.pb, self.model = pb, model

    def stream(self, tensors: dict[str, np.ndarray]) -> Iterator[tuple[str | None, dict]]:
        request = self.pb.InferenceRequest(
            model_name=self.model, requested_output_names=CHILD_OUTPUTS,
            inputs=[self.pb.Tensor(name, array) for name, array in tensors.items()])
        for response in request.exec(decoupled=True):
            if response.has_error():
                yield response.error().message(), {}
                return
            yield None, {t.name(): t.as_numpy() for t in response.output_tensors()}

    def cancel(self, room: int) -> None:
        request = self.pb.InferenceRequest(
            model_name=self.model, requested_output_names=[],
            inputs=[self.pb.Tensor("text_input", np.array([b"-"], dtype=np.object_)),
                    self.pb.Tensor("cancel_room", np.array([room], dtype=np.uint64))])
        for _ in request.exec(decoupled=True):
            pass


class RemoteChild:
    """A model on another tritonserver (another host), over gRPC."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def stream(self, tensors: dict[str, np.ndarray]) -> Iterator[tuple[str | None, dict]]:
        from client.stream import numpy_inputs, stream_events
        for error, outputs in stream_events(self.url, self.model, numpy_inputs(tensors), timeout_s=600):
            yield error, outputs or {}

    def cancel(self, room: int) -> None:
        from client.stream import numpy_inputs, stream_events
        inputs = numpy_inputs({"text_input": np.array([b"-"], dtype=np.object_),
                               "cancel_room": np.array([room], dtype=np.uint64)})
        for _ in stream_events(self.url, self.model, inputs, timeout_s=30):
            pass


class Relay:
    """Merges the two children's streams into the client's, each token once."""

    def __init__(self, room: int, client: ResponseStream):
        self.room, self.client = room, client
        self.lock = threading.Lock()
        self.forwarded = 0      # output tokens already sent to the client
        self.decoded = 0        # output tokens decode has sent
        self.done = False
        self.cancelled = False

    def from_prefill(self, outputs: dict) -> None:
        ids, text = _ids(outputs), _text(outputs)
        with self.lock:
            if self.done or self.forwarded or not ids or not text:
                return  # decode got there first, or the first token is not a whole character yet
            self.forwarded = len(ids)
            self._send(RequestOutput(str(self.room), text, ids, num_prompt_tokens=_int(outputs, "num_input_tokens"),
                                     num_output_tokens=len(ids)))

    def from_decode(self, outputs: dict, final: bool) -> None:
        ids, text = _ids(outputs), _text(outputs)
        with self.lock:
            start, self.decoded = self.decoded, self.decoded + len(ids)
            if self.done:
                return
            if start < self.forwarded:  # prefill already streamed these tokens (same text, same detokenizer)
                if self.decoded > self.forwarded:
                    log.warning("room %d: decode output overlaps prefill's first token", self.room)
                ids, text = ids[self.forwarded - start:], ""
            if not (ids or text or final):
                return
            self.forwarded = max(self.forwarded, self.decoded)
            self.done = final
            self._send(RequestOutput(str(self.room), text, ids, finished=final,
                                     finish_reason=_str(outputs, "finish_reason") or None,
                                     num_prompt_tokens=_int(outputs, "num_input_tokens"),
                                     num_output_tokens=_int(outputs, "num_output_tokens")))

    def fail(self, message: str) -> bool:
        with self.lock:
            if self.done:
                return False
            self.done = True
            self._send(RequestOutput(str(self.room), finished=True, finish_reason="error", error=message))
            return True

    def _send(self, out: RequestOutput) -> None:
        self.client(out)


def _ids(outputs: dict) -> list[int]:
    return [int(t) for t in np.asarray(outputs.get("output_ids", [])).reshape(-1)]


def _text(outputs: dict) -> str:
    return _str(outputs, "text_output")


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
        params = model_parameters(args)
        get = lambda key, default: params.get(key, "").strip() or default
        self.prefill = self._child(get("prefill_url", ""), get("prefill_model", "prefill"))
        self.decode = self._child(get("decode_url", ""), get("decode_model", "decode"))
        self.default_max_tokens = int(get("default_max_tokens", "256"))
        self.threads = concurrent.futures.ThreadPoolExecutor(int(get("max_threads", "512")),
                                                             thread_name_prefix="tandem-router")
        self.latencies = LatencyMetrics(self.pb, args.get("model_name", "router"))
        self.relays: dict[int, Relay] = {}
        self.lock = threading.Lock()
        self._start_watcher()

    def _child(self, url: str, model: str):
        return RemoteChild(url, model) if url else LocalChild(self.pb, model)

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        try:
            parsed = parse_request(inputs.get, self.default_max_tokens)
        except InvalidRequest as exc:
            self._reject(sender, str(exc))
            return
        room = random.getrandbits(62) + 1
        wanted = tuple(request.requested_output_names()) or OUTPUTS
        relay = Relay(room, ResponseStream(self.pb, sender, parsed, wanted, lambda _id: self._abort(room),
                                           self.latencies))
        with self.lock:
            self.relays[room] = relay
        child_inputs = {**inputs, "stream": np.array([True]), "exclude_input_in_output": np.array([True]),
                        "bootstrap_room": np.array([room], dtype=np.uint64)}
        self.threads.submit(self._run, relay, self.decode, child_inputs, True)
        self.threads.submit(self._run, relay, self.prefill, child_inputs, False)

    def _run(self, relay: Relay, child, inputs: dict, is_decode: bool) -> None:
        name = "decode" if is_decode else "prefill"
        try:
            last = None
            for error, outputs in child.stream(inputs):
                if error:
                    self._child_failed(relay, f"{name}: {error}", other=self.prefill if is_decode else self.decode)
                    return
                if is_decode:
                    if last is not None:
                        relay.from_decode(last, final=False)
                    last = outputs
                else:
                    relay.from_prefill(outputs)
            if is_decode:
                relay.from_decode(last or {}, final=True)
        except Exception as exc:
            log.exception("room %d: %s stream failed", relay.room, name)
            self._child_failed(relay, f"{name} failed: {exc}", other=self.prefill if is_decode else self.decode)
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
        with self.lock:
            relays = list(self.relays.values())
        for relay in relays:
            if relay.client.cancelled():
                self._abort(relay.room)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
