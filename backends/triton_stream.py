"""What every Tandem model.py shares, engine or not (the router has no engine): the sink
that turns engine outputs into Triton responses, the model skeleton with its cancel
watcher, and the latency histograms. Imports neither Triton nor torch; `pb` is the
`triton_python_backend_utils` module, passed in by model.py.
"""
from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import sys
import threading
import time

from backends.request import RequestOutput
from backends.token_channel import Writer
from backends.triton_io import PER_TOKEN_OUTPUTS, GenerateRequest, output_arrays

log = logging.getLogger("tandem.adapter")
# Every is_cancelled() is a round trip to the server process (~0.2 ms of both cores' time
# on this 2-core CPU), once per stream per poll: 0.1 s keeps that near 10 per stream per
# second and stops a cancelled stream within a few tokens.
CANCEL_POLL_S = 0.1
# The Triton request parameter a router puts on its BLS requests: the process that reads the
# child's responses. Triton cancels nothing when a stub dies, so a child whose parent is
# gone ends the request itself (see EngineModel.poll).
PARENT_PARAMETER = "tandem_parent"


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # [state, ppid, ...]; the name may hold spaces


def process_identity(pid: int | None = None) -> str:
    """pid:start time, so that a reused pid is not taken for the process that died."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_stat(pid)[19]}"


def process_alive(identity: str) -> bool:
    """A dead stub stays a zombie until the server reaps it: that counts as gone."""
    try:
        fields = _stat(int(identity.split(":")[0]))
    except (OSError, ValueError):
        return False
    return f"{identity.split(':')[0]}:{fields[19]}" == identity and fields[0] not in "ZX"


def request_parameters(request) -> dict:
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError):
        return {}
    return parameters if isinstance(parameters, dict) else {}


def model_parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


class ResponseStream:
    """The sink of one request: turns engine outputs into Triton responses."""

    def __init__(self, pb, sender, req: GenerateRequest, wanted: tuple[str, ...], on_gone,
                 latencies: "LatencyMetrics | None" = None, channel: "Writer | None" = None):
        self.pb, self.sender, self.req, self.wanted = pb, sender, req, wanted
        # The router's token channel (backends.token_channel): outputs go there, and the BLS
        # stream carries only its end.
        self.channel = channel
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
        self.text, self.ids, self.logprobs = [], [], []
        self.cumulative = 0.0   # the sampled tokens' logprobs summed (cum_log_probs, cumulative_logprob)
        # Triton frees the response factory with the final response; asking it
        # is_cancelled() after that crashes the server, so both hold this lock.
        self.lock = threading.Lock()
        self.closed = False
        # Its reader (a BLS parent) died: a send would never return and may hold the lock.
        self.orphaned = False

    def orphan(self) -> None:
        self.orphaned = True

    def __call__(self, out: RequestOutput) -> None:
        if self.orphaned:
            return
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
        if self.orphaned:
            return True
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
        if out.logprobs:
            self.cumulative += sum(entry[token][0] for token, entry in zip(out.token_ids, out.logprobs))
        if not self.req.stream:
            self.text.append(out.text)
            self.ids.extend(out.token_ids)
            self.logprobs.extend(out.logprobs or ())
            if not out.finished:
                return
            out = RequestOutput(out.request_id, "".join(self.text), self.ids, True, out.finish_reason,
                                num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
                                num_cached_tokens=out.num_cached_tokens,
                                logprobs=self.logprobs if self.req.params.logprobs is not None else None)
        if self.channel is not None:
            return self._send_by_channel(out, final)
        text, self.prefix = self.prefix + out.text, ""
        wanted = self.wanted if self.responses == 0 or out.finished else self.wanted_mid
        self.responses += 1
        arrays = output_arrays(text, out.token_ids, out.finish_reason, out.num_prompt_tokens,
                               out.num_output_tokens, wanted, out.logprobs, self.cumulative,
                               num_cached=out.num_cached_tokens)
        tensors = [self.pb.Tensor(name, array) for name, array in arrays.items()]
        self.sender.send(self.pb.InferenceResponse(output_tensors=tensors), flags=final)

    def _send_by_channel(self, out: RequestOutput, final: int) -> None:
        try:
            self.channel.send(self.req.room, out)
        except OSError as exc:
            # The router lost this stream's order: end it over BLS, and the raise aborts it here.
            self.closed, self.channel = True, None
            error = self.pb.TritonError(f"decode lost its token channel to the router: {exc}")
            self.sender.send(self.pb.InferenceResponse(output_tensors=[], error=error),
                             flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            raise
        if final:
            self.sender.send(flags=final)


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
        # A metric freed after the stub has shut down its IPC crashes the stub at exit
        # ("segfault at 60" in triton_python_backend_stub, Triton 2.51): free them now.
        for metrics in (getattr(self, "metrics", None), getattr(self, "latencies", None)):
            if metrics is not None:
                metrics.release()
        # Registered last, it runs first when the stub's interpreter exits: see exit_now.
        atexit.register(exit_now)


def exit_now() -> None:
    """The end of a stub whose finalize has closed everything: the process ends here, without
    Python's teardown. That teardown walks the whole heap the engine froze (backends.engine
    hands it back to the collector at exit), 2-3 s of CPU per engine process; the three engine
    stubs of the default repository did it at once on 2 cores and held their models' unload
    4-7 s after a SIGTERM (docs/shutdown.md)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


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

    def release(self) -> None:
        """Frees the metrics (each one before its family); nothing is observed after this."""
        self.histograms.clear()
        self.families.clear()

    def record(self, kind: str, seconds: float) -> None:
        self.pending.append((kind, seconds))

    def flush(self) -> None:
        while self.pending:
            kind, seconds = self.pending.popleft()
            self.histograms[kind].observe(seconds)
