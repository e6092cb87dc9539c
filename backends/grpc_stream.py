"""One streamed request over Triton gRPC, as (error, outputs) per response: what the router
reads from a remote child, and what the client tools build on (client.stream)."""
from __future__ import annotations

import queue
from typing import Iterator

import numpy as np


def numpy_inputs(values: dict[str, np.ndarray]):
    """tritonclient InferInputs from numpy arrays, the Triton datatype read off each array."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream_events(url: str, model: str, inputs, request_id: str = "", timeout_s: float = 300
                  ) -> Iterator[tuple[str | None, dict | None]]:
    """Yields (error, outputs) per response of one streamed request until the final one."""
    import tritonclient.grpc as grpcclient

    events: queue.Queue = queue.Queue()

    def callback(result, error):
        events.put((result, error))

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    ended = False   # the final response came: nothing is left to cancel
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = events.get(timeout=timeout_s)
            if error is not None:
                yield str(error), None
                return
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if outputs:
                yield None, outputs
            if final is not None and final.bool_param:
                ended = True
                return
    finally:
        # Cancelling a request that has ended can leave its model referenced for good in
        # tritonserver 2.51: that model is then never finalized at shutdown (docs/shutdown.md).
        client.stop_stream(cancel_requests=not ended)
        client.close()
