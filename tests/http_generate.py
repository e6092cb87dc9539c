"""Triton's HTTP generate extension, with nothing but the standard library: what a
user's `curl -X POST .../generate` or `.../generate_stream` gets."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def _post(url: str, body: dict, timeout_s: float):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(request, timeout=timeout_s)


def generate(http_port: int, model: str, body: dict, timeout_s: float = 120) -> tuple[int, dict]:
    """POST /v2/models/<model>/generate: (HTTP status, the JSON answer)."""
    try:
        with _post(f"http://localhost:{http_port}/v2/models/{model}/generate", body, timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def generate_stream(http_port: int, model: str, body: dict, timeout_s: float = 120) -> list[dict]:
    """POST /v2/models/<model>/generate_stream: the server-sent events' JSON, in order."""
    events = []
    with _post(f"http://localhost:{http_port}/v2/models/{model}/generate_stream", body, timeout_s) as r:
        for raw in r:
            line = raw.decode("utf-8").strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    return events
