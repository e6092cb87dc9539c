"""The thin Triton adapter every engine model.py uses.

    execute(requests):  parse tensors -> engine.generate(sink=ResponseStream)
    engine thread:      RequestOutput -> the stream's Outbox (never waits)
    send threads:       Outbox -> ResponseStream -> response_sender.send, each stream in order
    watcher thread:     client cancelled -> engine.abort (frees its KV)

`pb` is the `triton_python_backend_utils` module, passed in by model.py so this
file imports without Triton (tests drive it with a stand-in).
"""
from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import signal
import threading
import queue
from typing import Callable

import numpy as np

from backends.config import EngineConfig
from backends.parameters import refuse_unknown
from backends.engine import Engine, InvalidRequest, disagg_config
from backends.request import RequestOutput, merged
from backends.triton_io import control_room, is_describe, parse_request
from backends.token_channel import PARAMETER as CHANNEL_PARAMETER
from backends.token_channel import Writer, Writers
from backends.triton_stream import (PARENT_PARAMETER, LatencyMetrics, ResponseStream, StreamingModel, model_parameters,
                                    process_alive, request_parameters)

log = logging.getLogger("tandem.adapter")
# A send waits 0.5 ms p50 for the server process to take the response, nearly all of it the
# two processes waking each other (the stub's send threads and the server take ~0.2 ms of
# CPU a send); 4 threads overlap those waits (2 and 4 alike on a 2-core CPU, 8 and 16 no
# better: docs/bench.md).
SEND_THREADS = 4


def room_request_id(room: int) -> str:
    return f"room-{room}"


def engine_parameter_names(role: str) -> set[str]:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    if role != "colocated":
        from backends.disagg.config import DisaggConfig
        names |= {f.name for f in dataclasses.fields(DisaggConfig)}
    return names


class EngineModel(StreamingModel):
    """Base of the `llm`, `prefill` and `decode` models' TritonPythonModel."""

    role = "colocated"

    def initialize(self, args: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        # A stub that will not stop can be asked where it is: SIGUSR1 writes every thread's stack
        # to the server's log (tests/test_shutdown.py does when a stop takes too long).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        self.params = model_parameters(args)
        refuse_unknown(self.params, engine_parameter_names(self.role), args.get("model_name", self.role))
        self.cfg = EngineConfig.from_params(self.params, role=self.role)
        self.disagg = disagg_config(self.role, self.params)
        self.sends = SendPool(SEND_THREADS)
        self.channels = Writers()   # to the routers that asked for their tokens by channel
        self.engine = self.create_engine()
        self.engine.start()
        # request id -> (its stream, the process reading it when the request came over BLS, its outbox)
        self.streams: dict[str, tuple[ResponseStream, str | None, Outbox]] = {}
        self.lock = threading.Lock()
        self.metrics = EngineMetrics(self.pb, args.get("model_name", "llm"), self.engine.stats())
        self.latencies = LatencyMetrics(self.pb, args.get("model_name", "llm"))
        self._start_watcher()
        log.info("engine ready: %s", self.engine.describe())

    def create_engine(self) -> Engine:
        if self.cfg.dp_size > 1 or self.cfg.own_process:  # in processes of their own (DP attention, or one)
            from backends.dp_group import DpGroup
            return DpGroup(self.cfg, self.disagg)
        return Engine(self.cfg, disagg=self.disagg)

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        try:
            # by name once: pb.get_input_tensor_by_name walks request.inputs(), which wraps every
            # input again on each call (parse_request asks for about twenty names)
            inputs = {t.name(): t for t in request.inputs()}
            get = lambda name: t.as_numpy() if (t := inputs.get(name)) is not None else None
            room = control_room(get)
            if room is not None:
                self.engine.abort(room_request_id(room))
                sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            if is_describe(get):
                self._describe(sender)
                return
            req = parse_request(get, self.cfg.default_max_tokens)
            if (req.room is None) != (self.role == "colocated"):
                raise InvalidRequest(f"the {self.role} model {'needs' if req.room is None else 'takes no'} "
                                     "bootstrap_room (send requests to `router` or `llm`)")
            ids = self.engine.tokenize(req.prompt, chat=req.chat)
            wanted = req.wanted(tuple(request.requested_output_names()))
            parameters = request_parameters(request)
            parent = parameters.get(PARENT_PARAMETER)
            stream = ResponseStream(self.pb, sender, req, wanted, self.engine.abort, self.latencies,
                                    self._channel(parent, parameters))
            outbox = self._outbox(stream)
            engine_request = self.engine.make_request(
                ids, req.params, outbox.put, room=req.room,
                request_id=None if req.room is None else room_request_id(req.room), cache_salt=req.cache_salt,
                prefill_agent=req.prefill_agent)
        except InvalidRequest as exc:
            self._reject(sender, str(exc))
            return
        except Exception as exc:  # never let one request take the model down
            log.exception("request failed")
            self._reject(sender, f"internal error: {exc}")
            return
        with self.lock:
            self.streams[engine_request.id] = (stream, parent, outbox)
        self.engine.submit(engine_request)

    def _describe(self, sender) -> None:
        """The router's health check: this engine answers who it is (text_output, JSON)."""
        text = json.dumps(self.engine.identity()).encode()
        tensor = self.pb.Tensor("text_output", np.array([text], dtype=np.object_))
        sender.send(self.pb.InferenceResponse(output_tensors=[tensor]),
                    flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _channel(self, parent: str | None, parameters: dict) -> Writer | None:
        """The token channel of the router that sent this request, if it asked for one."""
        if not (parent and parameters.get(CHANNEL_PARAMETER) and self.role == "decode"):
            return None
        return self.channels.get(parent)

    def _outbox(self, stream: ResponseStream) -> Outbox:
        def send(out: RequestOutput) -> None:
            stream(out)
            if out.finished:
                with self.lock:
                    self.streams.pop(out.request_id, None)
        return Outbox(self.sends, send, self.cfg.stream_backlog)

    def poll(self) -> None:
        with self.lock:
            streams = list(self.streams.items())
        alive: dict[str, bool] = {}  # one look in /proc per parent a poll
        for request_id, (stream, parent, outbox) in streams:
            if stream.orphaned:
                continue  # aborted already; its end is on the way
            if parent is not None and parent not in alive:
                alive[parent] = process_alive(parent)
            if parent is not None and not alive[parent]:
                log.warning("%s: the process that sent it over BLS is gone; aborting", request_id)
                stream.orphan()
                self.sends.unstick(outbox)
                self.engine.abort(request_id)
            elif stream.cancelled():
                self.engine.abort(request_id)
        self.metrics.update(self.engine.stats())
        self.latencies.flush()

    def close(self) -> None:
        self.engine.stop()
        self.sends.close()
        self.channels.close()


class SendPool:
    """Every stream's responses, sent from a few threads; the engine never waits for a send.

    A stream has one send in flight at most: outputs that come meanwhile (the engine ran
    ahead of Triton) wait in its `Outbox`, each to be a response of its own, as Triton's
    TensorRT-LLM backend streams; when more than `backlog` wait, they go out as one response
    carrying all their tokens, as vLLM's AsyncLLM merges a request's outputs when its reader
    lags (a lagging stream catches up, and a load tool still sees a response per token
    whenever the server keeps up). A stream keeps its order; a slow send costs that stream
    its pace, not the batch its step time (the previous shape waited after each forward for
    the last step's sends: 64 streams of an 8B model on an H100 stepped 17.9 ms through
    tritonserver against 10.2 ms in-process).
    Streams take turns: an outbox sends once, then queues again behind the others.

    A send to a BLS parent that died never returns (Triton 2.51): when the watcher orphans a
    stream whose send is in flight, a new thread takes the stuck one's place (`unstick`).
    The threads are daemons, so a stuck one does not hold the stub at exit."""

    def __init__(self, threads: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [self._add_thread() for _ in range(threads)]

    def _add_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._work, name="tandem-send", daemon=True)
        thread.start()
        return thread

    def _work(self) -> None:
        while (outbox := self.jobs.get()) is not None:
            outbox.send_next()

    def unstick(self, outbox: "Outbox") -> None:
        if outbox.sending:
            log.warning("a send is stuck (its BLS reader is gone); a new thread takes its place")
            self.threads.append(self._add_thread())

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
        for thread in self.threads:
            thread.join(timeout=1)


class Outbox:
    """One stream's outputs on their way out: `put` from the engine thread, sent by the pool."""

    def __init__(self, pool: SendPool, send: Callable[[RequestOutput], None], backlog: int):
        self.pool, self.send, self.backlog = pool, send, backlog
        self.lock = threading.Lock()
        self.waiting: list[RequestOutput] = []
        self.queued = False    # in the pool's queue or being sent
        self.sending = False   # a send of this stream is running now

    def put(self, out: RequestOutput) -> None:
        with self.lock:
            self.waiting.append(out)
            if self.queued:
                return
            self.queued = True
        self.pool.jobs.put(self)

    def send_next(self) -> None:
        with self.lock:
            if len(self.waiting) > self.backlog:
                outs, self.waiting = merged(self.waiting), []
            else:
                outs, self.waiting = self.waiting[:1], self.waiting[1:]
            self.sending = True
        try:
            for out in outs:
                self.send(out)  # a stream's own failures end that stream (ResponseStream.__call__)
        except Exception:
            log.exception("sending a response failed")
        with self.lock:
            self.sending = False
            self.queued = bool(self.waiting)
        if self.queued:
            self.pool.jobs.put(self)


class EngineMetrics:
    """Engine gauges and counters on Triton's metrics port (label: model)."""

    GAUGES = {
        "kv_pages_free": "KV cache pages free",
        "kv_pages_cached": "KV cache pages that hold a cached prompt prefix and no request holds (evicted when "
                           "pages are needed); idle: free + cached = total",
        "kv_pages_total": "KV cache pages in the pool",
        "running": "requests in the running batch",
        "waiting": "requests waiting to be scheduled",
        "kv_bytes_sent": "KV and metadata bytes written to decode engines (prefill)",
        "transfer_failures": "requests whose KV hand-off failed",
        "transferring": "requests waiting for their KV (decode)",
        "quarantined_pages": "KV pages held until the prefill side confirms no write is in flight (decode)",
        "dp_ranks_alive": "engine processes running (DP ranks, or the one of engine_process own); fewer than "
                          "started: the model stopped serving",
    }
    COUNTERS = {  # vLLM's prefix cache counters (in tokens), and decode's reused KV (bytes)
        "prefix_cache_queries": "prompt tokens looked up in the prefix cache",
        "prefix_cache_hits": "prompt tokens found in the prefix cache (their KV was not computed again)",
        "kv_bytes_reused": "KV bytes of prompts decode held already, so prefill did not send them (decode)",
    }

    def __init__(self, pb, model: str, stats: dict):
        # A family must outlive its metrics, so both are kept; only this engine's stats get one.
        kinds = {**{key: (doc, pb.MetricFamily.GAUGE) for key, doc in self.GAUGES.items()},
                 **{key: (doc, pb.MetricFamily.COUNTER) for key, doc in self.COUNTERS.items()}}
        self.families = {key: pb.MetricFamily(name=f"tandem_{key}", description=doc, kind=kind)
                         for key, (doc, kind) in kinds.items() if key in stats}
        self.gauges = {key: family.Metric(labels={"model": model}) for key, family in self.families.items()}
        self.values: dict[str, float] = {}

    def release(self) -> None:
        """Frees the gauges (each one before its family); nothing is set after this."""
        self.gauges.clear()
        self.families.clear()

    def update(self, stats: dict) -> None:
        """Sets the gauges whose value changed and moves the counters on by what they grew
        (each call is a round trip to the server)."""
        for key, metric in self.gauges.items():
            value = float(stats[key])
            if self.values.get(key) != value:
                if key in self.COUNTERS:
                    metric.increment(value - self.values.get(key, 0.0))
                else:
                    metric.set(value)
                self.values[key] = value
