"""The decode -> router token channel (backends.token_channel) and the decode stream that
writes to it, without tritonserver (test_router.py runs it through the real server)."""
import queue
import socket
import struct
import uuid

import pytest

from backends.request import RequestOutput
from backends.token_channel import HEADER, Listener, Writer, Writers, address
from backends.triton_io import GenerateRequest
from backends.request import SamplingParams


def listen():
    """A listener under a fresh identity, and a queue of the batches it delivers."""
    identity, batches = f"test-{uuid.uuid4().hex}", queue.Queue()
    return identity, Listener(identity, batches.put), batches


def received(batches, count: int) -> list:
    got = []
    while len(got) < count:
        got.extend(batches.get(timeout=5))
    return got


def test_outputs_arrive_whole_and_in_order():
    identity, listener, batches = listen()
    writer = Writer(identity)
    outs = [RequestOutput("", f"piece {i} é東", [i, i + 1], num_prompt_tokens=7, num_output_tokens=2 * i)
            for i in range(200)]
    outs.append(RequestOutput("", "", [], finished=True, finish_reason="length", num_prompt_tokens=7,
                              num_output_tokens=400))
    for out in outs:
        writer.send(123, out)
    got = received(batches, len(outs))
    assert [room for room, _ in got] == [123] * len(outs)
    assert [out for _, out in got] == [RequestOutput("123", o.text, o.token_ids, o.finished, o.finish_reason,
                                                     o.error, o.num_prompt_tokens, o.num_output_tokens)
                                       for o in outs]
    writer.close()
    listener.close()


def test_a_bad_frame_drops_that_peer_only():
    identity, listener, batches = listen()
    rogue = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rogue.connect(address(identity))
    rogue.settimeout(5)
    body = b"not json"
    rogue.sendall(HEADER.pack(len(body)) + body)
    assert rogue.recv(1) == b"", "the listener closes a connection that sent a bad frame"
    writer = Writer(identity)
    writer.send(5, RequestOutput("", "ok", [1]))
    assert received(batches, 1)[0][1].text == "ok"
    listener.close()


def test_no_router_listening_means_bls():
    assert Writers().get(f"nobody-{uuid.uuid4().hex}") is None


def test_a_send_to_a_closed_router_fails_and_the_writer_stays_broken():
    identity, listener, _ = listen()
    writers = Writers()
    writer = writers.get(identity)
    listener.close()
    with pytest.raises(OSError):
        for _ in range(1000):  # the first sends may still land in the socket's buffer
            writer.send(1, RequestOutput("", "x" * 1000, [1]))
    with pytest.raises(OSError):
        writer.send(1, RequestOutput("", "y", [2]))
    assert writers.get(identity) is None, "a broken writer is replaced, and nobody listens any more"


class Pb:
    """The parts of triton_python_backend_utils that ResponseStream uses."""
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError:
        def __init__(self, message):
            self.message = message

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array


class Sender:
    def __init__(self):
        self.sent = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


def decode_stream(writer):
    from backends.triton_stream import ResponseStream
    req = GenerateRequest("p", SamplingParams(max_tokens=4), stream=True, exclude_input=True, chat=False, room=77)
    gone, sender = [], Sender()
    return ResponseStream(Pb, sender, req, ("text_output",), gone.append, channel=writer), sender, gone


def test_a_decode_stream_with_a_channel_sends_only_its_end_over_bls():
    identity, listener, batches = listen()
    stream, sender, gone = decode_stream(Writer(identity))
    stream(RequestOutput("room-77", "Hel", [1]))
    stream(RequestOutput("room-77", "lo", [2], finished=True, finish_reason="stop", num_output_tokens=2))
    got = received(batches, 2)
    assert [(room, out.text, out.finish_reason) for room, out in got] == [(77, "Hel", None), (77, "lo", "stop")]
    assert sender.sent == [(None, Pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)] and gone == []
    listener.close()


def test_a_decode_stream_whose_channel_breaks_ends_with_an_error_and_aborts():
    identity, listener, _ = listen()
    writer = Writer(identity)
    stream, sender, gone = decode_stream(writer)
    writer.close()
    stream(RequestOutput("room-77", "Hel", [1]))
    (response, flags), = sender.sent
    assert flags == Pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and "token channel" in response.error.message
    assert gone == ["room-77"], "the request is aborted, so its KV is freed"
    stream(RequestOutput("room-77", "", [], finished=True, finish_reason="abort"))
    assert len(sender.sent) == 1, "nothing follows the final response"
    listener.close()


def test_the_router_forwards_a_batch_per_relay_in_order():
    """Frames of several rooms that came together: each relay gets its own in order; a relay
    whose attempt failed (its decode room cancelled, an abort on its way) gets none."""
    import concurrent.futures
    import threading
    import types

    from backends.disagg.router import RouterModel

    class Relay:
        def __init__(self, ended: bool = False):
            self.got, self.attempt = [], types.SimpleNamespace(ended=ended)

        def from_decode(self, out):
            self.got.append(out.text)

    router = RouterModel.__new__(RouterModel)
    router.lock, router.threads = threading.Lock(), concurrent.futures.ThreadPoolExecutor(4)
    router.relays = {1: Relay(), 2: Relay(), 4: Relay(ended=True)}
    batch = [(1, RequestOutput("", "a")), (2, RequestOutput("", "x")), (1, RequestOutput("", "b")),
             (3, RequestOutput("", "gone")), (4, RequestOutput("", "aborted")), (2, RequestOutput("", "y")),
             (1, RequestOutput("", "c"))]
    router._from_channel(batch)
    assert router.relays[1].got == ["a", "b", "c"] and router.relays[2].got == ["x", "y"]
    assert router.relays[4].got == []
    router.threads.shutdown()


def test_frames_are_length_prefixed_json():
    body = b'[9, "t", [1], false, null, 3, 1, null]'
    frame = HEADER.pack(len(body)) + body
    assert struct.unpack("<I", frame[:4])[0] == len(body)
    batch, rest = Listener._frames(frame + frame[:6])
    assert [(room, out.text, out.token_ids) for room, out in batch] == [(9, "t", [1])] and rest == frame[:6]


def test_a_frame_carries_logprobs_with_int_token_ids():
    """JSON keys are strings: the frame keeps each token's Logprob dict as (id, value) pairs."""
    from backends.request import RequestOutput
    from backends.token_channel import decode, encode
    logprobs = [{7: (-0.5, 1, " a"), 3: (-1.5, 2, "b")}]
    room, out = decode(encode(9, RequestOutput("x", "a", [7], logprobs=logprobs))[HEADER.size:])
    assert room == 9 and out.logprobs == logprobs and list(out.logprobs[0]) == [7, 3]


@pytest.mark.parametrize("frame_comes", [True, False])
def test_the_router_waits_for_decodes_last_frame_after_its_bls_end(monkeypatch, frame_comes):
    """Decode's BLS stream can end before the channel's reader has forwarded the final frame:
    the router waits for it (a short grace here), and fails the stream only if it never comes."""
    import threading

    import concurrent.futures

    from backends.disagg import router as router_module
    from backends.disagg.endpoints import Endpoint, Endpoints, RoutingConfig
    from backends.disagg.router import Attempt, Relay, RouterModel

    monkeypatch.setattr(router_module, "CHANNEL_GRACE_S", 2.0)  # the frame comes at 0.1 s

    class Child:
        model, cancelled, channel = "child", [], True

        def stream(self, inputs):
            yield None, RequestOutput("", "", [])  # the bare end a channel stream sends over BLS

        def cancel(self, room):
            self.cancelled.append(room)

    sent = []
    router = RouterModel.__new__(RouterModel)
    router.lock, router.listener = threading.Lock(), object()
    router.threads = concurrent.futures.ThreadPoolExecutor(2)
    prefill, decode = Endpoint("prefill", "local", Child()), Endpoint("decode", "local", Child())
    router.endpoints = Endpoints([prefill], [decode], RoutingConfig(),
                                 lambda ep: {"role": ep.kind, "agent": "a", "nixl_port": 1})
    relay = Relay(9, sent.append)
    relay.attempt = Attempt(9, prefill, decode, 16, {})
    router.relays = {9: relay}
    if frame_comes:
        final = RequestOutput("", "end", [5], finished=True, finish_reason="stop", num_output_tokens=1)
        threading.Timer(0.1, relay.from_decode, args=(final,)).start()
    router._run(relay, relay.attempt, True, {})
    assert [out.finish_reason for out in sent] == (["stop"] if frame_comes else ["error"])
    assert frame_comes or "without a finish reason" in sent[0].error
    assert router.relays == {}
    router.threads.shutdown()
