"""Knobs of the disaggregated hand-off, from the same config.pbtxt parameters
as the engine's (each model reads the ones that concern it)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class DisaggConfig:
    nixl_port: int = field(default=17555, metadata={
        "doc": "prefill: port its NIXL agent listens on; decode: 0 (any free port)"})
    prefill_address: str = field(default="127.0.0.1:17555", metadata={
        "doc": "decode: host:port of the prefill engine's NIXL agent (another host in a two-host set-up)"})
    handshake_timeout_s: float = field(default=10.0, metadata={
        "doc": "decode: how long to wait for the prefill engine's NIXL metadata"})
    transfer_timeout_s: float = field(default=30.0, metadata={
        "doc": "longest a request may wait for its KV once decode reserved it, or for its destination on prefill "
               "(unless decode said it is queued: overload queues, it does not fail); prefill drops a destination "
               "for a request it never got after twice this"})
    decode_reserve_tokens: int = field(default=128, metadata={
        "doc": "decode: KV kept free per admitted request for the tokens it will still decode"})
    meta_slots: int = field(default=256, metadata={"doc": "metadata slots (first token, lengths) per engine"})
    prefill_before_destination: str = field(default="auto", metadata={
        "doc": "prefill: auto (a prompt whose KV is written after its forward, see pipeline_min_tokens, runs "
               "while decode's destination for it is on the way) or off (every prompt waits for it)"})
    pipeline: str = field(default="auto", metadata={
        "doc": "prefill: auto (layer-pipelined KV writes above pipeline_min_tokens) or off (one write after the forward)"})
    pipeline_min_tokens: int = field(default=256, metadata={
        "doc": "prefill: below this many new tokens in a step, KV is written after the forward"})
    pipeline_max_iters: int = field(default=10, metadata={"doc": "prefill: layer groups for the shortest pipelined prompts"})
    pipeline_min_iters: int = field(default=4, metadata={"doc": "prefill: layer groups for the longest prompts"})
    pipeline_saturation: float = field(default=3.0, metadata={
        "doc": "prefill: prompts of pipeline_min_tokens x this use pipeline_min_iters groups"})
    pipeline_group_size: int = field(default=0, metadata={"doc": "prefill: fixed layers per group (0 = adaptive)"})

    def __post_init__(self):
        problems = [f"{name} must be {rule}, got {getattr(self, name)!r}" for name, rule, ok in (
            ("pipeline", "auto or off", self.pipeline in ("auto", "off")),
            ("prefill_before_destination", "auto or off", self.prefill_before_destination in ("auto", "off")),
            ("nixl_port", "a port (0-65535)", 0 <= self.nixl_port <= 65535),
            ("handshake_timeout_s", "> 0", self.handshake_timeout_s > 0),
            ("transfer_timeout_s", "> 0", self.transfer_timeout_s > 0),
            ("decode_reserve_tokens", ">= 0", self.decode_reserve_tokens >= 0),
            ("meta_slots", ">= 1", self.meta_slots >= 1),
            ("pipeline_min_tokens", ">= 0", self.pipeline_min_tokens >= 0),
            ("pipeline_min_iters", ">= 1 and <= pipeline_max_iters",
             1 <= self.pipeline_min_iters <= self.pipeline_max_iters),
            ("pipeline_saturation", "> 1", self.pipeline_saturation > 1),
            ("pipeline_group_size", ">= 0 (0 = adaptive)", self.pipeline_group_size >= 0),
        ) if not ok]
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def prefill_host_port(self) -> tuple[str, int]:
        host, _, port = self.prefill_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"prefill_address must be host:port, got {self.prefill_address!r}")
        return host, int(port)

    @staticmethod
    def from_params(params: dict[str, str], **overrides) -> "DisaggConfig":
        values = {}
        for f in fields(DisaggConfig):
            text = params.get(f.name, "").strip()
            if text:
                try:
                    values[f.name] = type(f.default)(text)
                except ValueError:
                    raise ValueError(f"{f.name} must be a {type(f.default).__name__}, got {text!r}") from None
        values.update(overrides)
        return DisaggConfig(**values)
