"""The thin Triton adapter every engine model.py uses.

    execute(requests):  parse tensors -> engine.generate(sink=ResponseStream)
    engine thread:      RequestOutput -> ResponseStream -> send pool -> response_sender.send,
                        all of a step's sends done before the next step
    watcher thread:     client cancelled -> engine.abort (frees its KV)

`pb` is the `triton_python_backend_utils` module, passed in by model.py so this
file imports without Triton (tests drive it with a stand-in).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from backends.config import EngineConfig, refuse_unknown
from backends.engine import Engine, InvalidRequest
from backends.request import RequestOutput
from backends.triton_io import OUTPUTS, PER_TOKEN_OUTPUTS, GenerateRequest, control_room, output_arrays, parse_request

log = logging.getLogger("tandem.adapter")
# Every is_cancelled() is a round trip to the server process (~0.2 ms of both cores' time
# on this 2-core CPU), once per stream per poll: 0.1 s keeps that near 10 per stream per
# second and stops a cancelled stream within a few tokens.
CANCEL_POLL_S = 0.1
# A send waits 0.5 ms p50 for the server process to take the response, nearly all of it the
# two processes waking each other (the stub's send threads and the server take ~0.2 ms of
# CPU a send). A step's sends from 4 threads overlap those waits: at 16 streams step to
# step went 30.8 / 29.1 -> 29.5 / 27.8 ms (two interleaved pairs; 2 and 4 threads alike,
# 8 and 16 no better).
SEND_THREADS = 4


def model_parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


class ResponseStream:
    """The sink of one request: turns engine outputs into Triton responses."""

    def __init__(self, pb, sender, req: GenerateRequest, wanted: tuple[str, ...], on_gone,
                 latencies: "LatencyMetrics | None" = None):
        self.pb, self.sender, self.req, self.wanted = pb, sender, req, wanted
        # Each response tensor costs the stub a shared-memory copy and the server a protobuf
        # field, so the constant ones ride only on the first and last response of a stream.
        self.wanted_mid = tuple(name for name in wanted if name in PER_TOKEN_OUTPUTS)
        self.responses = 0
        self.on_gone = on_gone
        self.latencies = latencies
        self.started, self.last_token_at = time.monotonic(), None
        # A stream carries new text only, as TensorRT-LLM's and vLLM's backends do (a client
        # that joins the pieces must not get the prompt): exclude_input_in_output=false is
        # honoured for one-response requests only.
        self.prefix = "" if req.exclude_input or req.stream else req.prompt
        self.text, self.ids = [], []
        # Triton frees the response factory with the final response; asking it
        # is_cancelled() after that crashes the server, so both hold this lock.
        self.lock = threading.Lock()
        self.closed = False

    def __call__(self, out: RequestOutput) -> None:
        try:
            with self.lock:
                if self.closed:
                    return
                self.closed = out.finished
                self._send(out)
        except Exception as exc:  # the client is gone: stop generating for it
            log.info("stream of %s closed: %s", out.request_id, exc)
            self.on_gone(out.request_id)

    def cancelled(self) -> bool:
        """Whether the client cancelled (or its stream cannot be asked any more)."""
        try:
            with self.lock:
                return not self.closed and self.sender.is_cancelled()
        except Exception:
            return True

    def _time(self, out: RequestOutput) -> None:
        if not out.token_ids or self.latencies is None:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            self.latencies.record("ttft", now - self.started)
        else:
            self.latencies.record("itl", (now - self.last_token_at) / len(out.token_ids))
        self.last_token_at = now

    def _send(self, out: RequestOutput) -> None:
        self._time(out)
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        if out.error:
            self.sender.send(self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(out.error)),
                             flags=final)
            return
        if not self.req.stream:
            self.text.append(out.text)
            self.ids.extend(out.token_ids)
            if not out.finished:
                return
            out = RequestOutput(out.request_id, "".join(self.text), self.ids, True, out.finish_reason,
                                num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens)
        text, self.prefix = self.prefix + out.text, ""
        wanted = self.wanted if self.responses == 0 or out.finished else self.wanted_mid
        self.responses += 1
        arrays = output_arrays(text, out.token_ids, out.finish_reason, out.num_prompt_tokens,
                               out.num_output_tokens, wanted)
        tensors = [self.pb.Tensor(name, array) for name, array in arrays.items()]
        self.sender.send(self.pb.InferenceResponse(output_tensors=tensors), flags=final)


def room_request_id(room: int) -> str:
    return f"room-{room}"


def engine_parameter_names(role: str) -> set[str]:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    if role != "colocated":
        from backends.disagg.config import DisaggConfig
        names |= {f.name for f in dataclasses.fields(DisaggConfig)}
    return names


def make_role(role: str, params: dict[str, str]):
    """The scheduler role of an engine model: None (colocated), prefill or decode."""
    if role == "colocated":
        return None
    from backends.disagg.config import DisaggConfig
    cfg = DisaggConfig.from_params(params)
    if role == "prefill":
        from backends.disagg.prefill import PrefillRole
        return PrefillRole(cfg)
    from backends.disagg.decode import DecodeRole
    return DecodeRole(cfg)


class StreamingModel:
    """What every Tandem model.py shares: requests started one by one in
    `execute` (decoupled: responses go out from other threads), a watcher
    thread that polls cancellation and publishes metrics, and a finalize after
    which nothing calls into the stub any more."""

    pb = None  # the triton_python_backend_utils module, set by model.py

    def execute(self, requests):
        for request in requests:
            self._start(request)
        return None

    def _start(self, request) -> None:
        raise NotImplementedError

    def _reject(self, sender, message: str) -> None:
        response = self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(message))
        sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _start_watcher(self) -> None:
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="tandem-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._closing.wait(CANCEL_POLL_S):
            try:
                self.poll()
            except Exception:
                log.exception("watcher poll failed")

    def poll(self) -> None:
        """Abort what clients cancelled; publish metrics (every CANCEL_POLL_S)."""

    def close(self) -> None:
        pass

    def finalize(self) -> None:
        # No call into the stub (metrics, is_cancelled, send) may outlive finalize:
        # one left waiting on a server that is gone keeps the stub process alive.
        self._closing.set()
        self._watcher.join(timeout=5)
        self.close()


class EngineModel(StreamingModel):
    """Base of the `llm`, `prefill` and `decode` models' TritonPythonModel."""

    role = "colocated"

    def initialize(self, args: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.params = model_parameters(args)
        refuse_unknown(self.params, engine_parameter_names(self.role), args.get("model_name", self.role))
        self.cfg = EngineConfig.from_params(self.params, role=self.role)
        self.sends = SendPool(SEND_THREADS)
        self.engine = self.create_engine()
        self.engine.start()
        self.streams: dict[str, tuple[object, ResponseStream]] = {}
        self.lock = threading.Lock()
        self.metrics = EngineMetrics(self.pb, args.get("model_name", "llm"), self.engine.stats())
        self.latencies = LatencyMetrics(self.pb, args.get("model_name", "llm"))
        self._start_watcher()
        log.info("engine ready: %s, %s, %s, attention %s, %d KV pages of %d tokens",
                 self.cfg.model_path, self.engine.runner.device, self.engine.runner.dtype,
                 self.engine.runner.attention_backend, self.engine.runner.pool.num_pages, self.cfg.page_size)

    def create_engine(self) -> Engine:
        engine = Engine(self.cfg, role=make_role(self.role, self.params))
        engine.scheduler.before_process = self.sends.drain
        return engine

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        try:
            get = lambda name: (t.as_numpy() if (t := self.pb.get_input_tensor_by_name(request, name)) is not None
                                else None)
            room = control_room(get)
            if room is not None:
                self.engine.abort(room_request_id(room))
                sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            req = parse_request(get, self.cfg.default_max_tokens)
            if (req.room is None) != (self.role == "colocated"):
                raise InvalidRequest(f"the {self.role} model {'needs' if req.room is None else 'takes no'} "
                                     "bootstrap_room (send requests to `router` or `llm`)")
            ids = self.engine.tokenize(req.prompt, chat=req.chat)
            wanted = tuple(request.requested_output_names()) or OUTPUTS
            stream = ResponseStream(self.pb, sender, req, wanted, self.engine.abort, self.latencies)
            engine_request = self.engine.make_request(
                ids, req.params, self._sink(stream), room=req.room,
                request_id=None if req.room is None else room_request_id(req.room))
        except InvalidRequest as exc:
            self._reject(sender, str(exc))
            return
        except Exception as exc:  # never let one request take the model down
            log.exception("request failed")
            self._reject(sender, f"internal error: {exc}")
            return
        with self.lock:
            self.streams[engine_request.id] = (request, stream)
        self.engine.scheduler.submit(engine_request)

    def _sink(self, stream: ResponseStream):
        def send(out: RequestOutput) -> None:
            stream(out)
            if out.finished:
                with self.lock:
                    self.streams.pop(out.request_id, None)
        return lambda out: self.sends.submit(send, out)

    def poll(self) -> None:
        with self.lock:
            streams = list(self.streams.items())
        for request_id, (_, stream) in streams:
            if stream.cancelled():
                self.engine.abort(request_id)
        self.metrics.update(self.engine.stats())
        self.latencies.flush()

    def close(self) -> None:
        self.engine.stop()
        self.sends.close()


class SendPool:
    """The responses of one engine step, sent from a few threads at once.

    Sinks run on the engine thread, which submits here. The scheduler calls `drain` after
    the next step's forward, before that step's outputs reach the sinks: a stream's
    responses keep their order (one a step) and a step's sends run during the next forward
    instead of the engine waiting for them (six interleaved pairs through tritonserver:
    8 streams 292 -> 305 tok/s, 16 streams 389 -> 406, medians; TTFT p50 at 8 277 -> 242 ms).
    Outputs handed out between a forward and its process (an abort's or a failed step's
    final response) may overtake a stream's pending token; ResponseStream drops what comes
    after its final response."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tandem-send")
        self.pending: list[Future] = []

    def submit(self, fn, *args) -> None:
        self.pending.append(self.pool.submit(fn, *args))

    def drain(self) -> None:
        pending, self.pending = self.pending, []
        for future in pending:  # a stream's own failures end that stream (ResponseStream.__call__)
            if (exc := future.exception()) is not None:
                log.error("sending a response failed: %r", exc)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class EngineMetrics:
    """Engine gauges on Triton's metrics port (label: model)."""

    GAUGES = {
        "kv_pages_free": "KV cache pages free",
        "kv_pages_total": "KV cache pages in the pool",
        "running": "requests in the running batch",
        "waiting": "requests waiting to be scheduled",
        "kv_bytes_sent": "KV and metadata bytes written to decode engines (prefill)",
        "transfer_failures": "requests whose KV hand-off failed",
        "transferring": "requests waiting for their KV (decode)",
        "quarantined_pages": "KV pages held until the prefill side confirms no write is in flight (decode)",
    }

    def __init__(self, pb, model: str, stats: dict):
        # A family must outlive its metrics, so both are kept; only this engine's stats get one.
        self.families = {key: pb.MetricFamily(name=f"tandem_{key}", description=doc, kind=pb.MetricFamily.GAUGE)
                         for key, doc in self.GAUGES.items() if key in stats}
        self.gauges = {key: family.Metric(labels={"model": model}) for key, family in self.families.items()}
        self.values: dict[str, float] = {}

    def update(self, stats: dict) -> None:
        """Sets the gauges whose value changed (each set is a round trip to the server)."""
        for key, gauge in self.gauges.items():
            value = float(stats[key])
            if self.values.get(key) != value:
                gauge.set(value)
                self.values[key] = value


class LatencyMetrics:
    """TTFT and ITL histograms. Values are queued by the sending thread and
    observed by the watcher, so the engine thread never waits on the metric IPC."""

    BUCKETS = {"ttft": [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30],
               "itl": [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1]}
    DOCS = {"ttft": "time to first token, seconds", "itl": "inter-token latency, seconds"}

    def __init__(self, pb, model: str):
        self.families = {k: pb.MetricFamily(name=f"tandem_{k}_seconds", description=self.DOCS[k],
                                            kind=pb.MetricFamily.HISTOGRAM) for k in self.DOCS}
        self.histograms = {k: f.Metric(labels={"model": model}, buckets=self.BUCKETS[k])
                           for k, f in self.families.items()}
        self.pending: collections.deque = collections.deque()

    def record(self, kind: str, seconds: float) -> None:
        self.pending.append((kind, seconds))

    def flush(self) -> None:
        while self.pending:
            kind, seconds = self.pending.popleft()
            self.histograms[kind].observe(seconds)
