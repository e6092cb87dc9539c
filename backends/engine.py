"""The engine: scheduler, runner and tokenizer behind a thread-safe front.

The Triton adapters (and tests, and benchmarks) call `generate` from any
thread; the scheduler's loop runs in one background thread and delivers
`RequestOutput`s to each request's sink from there.
"""
from __future__ import annotations

import atexit
import gc
import logging
import threading
import uuid
from typing import Callable

from backends.config import EngineConfig
from backends.detokenizer import IncrementalDetokenizer
from backends.model_config import ModelConfig
from backends.request import InvalidRequest, Request, RequestOutput, SamplingParams
from backends.runner import ModelRunner
from backends.role import ColocatedRole, EngineFacts, EngineOps, Role
from backends.scheduler import Scheduler

log = logging.getLogger("tandem.engine")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def tokenize(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    if chat:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return tokenizer(prompt, add_special_tokens=True).input_ids


def disagg_config(role: str, params: dict[str, str]):
    """The hand-off's settings of a prefill or decode model (None for colocated)."""
    if role == "colocated":
        return None
    from backends.disagg.config import DisaggConfig
    return DisaggConfig.from_params(params)


def make_role(role: str, disagg, facts: EngineFacts, engine: EngineOps) -> Role:
    """The scheduler role of an engine model (colocated, prefill or decode), built once the
    engine it serves exists. Here, where the engine is assembled: the role interface
    (backends.role) knows no role but its own."""
    if role == "colocated":
        return ColocatedRole()
    if disagg is None:
        raise ValueError(f"the {role} role needs the hand-off's settings (a DisaggConfig)")
    if role == "prefill":
        from backends.disagg.prefill import PrefillRole
        return PrefillRole(disagg, facts, engine)
    from backends.disagg.decode import DecodeRole
    return DecodeRole(disagg, facts, engine)


def engine_facts(runner: ModelRunner, scheduler: Scheduler) -> EngineFacts:
    """What a role may know of the engine."""
    return EngineFacts(kv=runner.kv, num_layers=runner.model.cfg.num_layers, device_type=runner.device.type,
                       kv_manager=scheduler.pool, prefix_caching=scheduler.caching, wake=scheduler.wake)


def refuse_dllm_settings(cfg: EngineConfig) -> None:
    """What a block-diffusion checkpoint cannot be served with, refused before it loads."""
    if not ModelConfig.load(cfg.model_path).is_dllm:
        return
    if cfg.role != "colocated":
        raise ValueError(f"{cfg.model_path} is a block-diffusion model: disaggregated prefill/decode is not "
                         "supported for it; serve it with `llm`")
    if cfg.overlap == "on":
        raise ValueError(f"{cfg.model_path} is a block-diffusion model: overlap is not supported for it "
                         "(a step's input is the block the step before it revealed)")


def check_request(mc: ModelConfig, max_context: int, prompt_ids: list[int], params: SamplingParams) -> None:
    """What makes a request unservable by this model, as InvalidRequest."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty")
    if not all(0 <= t < mc.vocab_size for t in prompt_ids):
        bad = next(t for t in prompt_ids if not 0 <= t < mc.vocab_size)
        raise InvalidRequest(f"the prompt has token id {bad}, outside this model's vocabulary of {mc.vocab_size} ids")
    if mc.is_dllm and params.temperature > 0:
        raise InvalidRequest(f"temperature {params.temperature:g}: serving a block-diffusion model is greedy "
                             "(temperature 0)")
    if mc.is_dllm and (used := [name for name, on in (("penalties", params.penalised), ("min_p", params.min_p > 0),
                                                         ("logprobs", params.logprobs is not None)) if on]):
        raise InvalidRequest(f"{', '.join(used)}: not supported for a block-diffusion model")
    if bad := [t for t in params.stop_token_ids if t >= mc.vocab_size]:
        raise InvalidRequest(f"stop_token_ids {bad} are not token ids of this model (vocabulary of {mc.vocab_size})")
    if params.end_id is not None and params.end_id >= mc.vocab_size:
        raise InvalidRequest(f"end_id {params.end_id} is not a token id of this model "
                             f"(vocabulary of {mc.vocab_size})")
    if len(prompt_ids) >= max_context:
        raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                             f"{max_context} tokens (prompt + output)")


class Engine:
    def __init__(self, cfg: EngineConfig, disagg=None, tokenizer=None, model=None):
        """disagg: the hand-off's settings (backends.disagg.config.DisaggConfig) of a prefill or
        decode engine (cfg.role); the role is built from them once runner and scheduler exist."""
        self.cfg = cfg
        refuse_dllm_settings(cfg)
        self.tokenizer = tokenizer or load_tokenizer(cfg.model_path)
        self.runner = ModelRunner(cfg, model)
        eos = self.runner.model.cfg.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.scheduler = Scheduler(cfg, self.runner, tuple(e for e in eos if e is not None))
        self.scheduler.role = make_role(cfg.role, disagg, engine_facts(self.runner, self.scheduler), self.scheduler)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    # ---- requests ------------------------------------------------------------------
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        return tokenize(self.tokenizer, prompt, chat)

    def make_request(self, prompt_ids: list[int], params: SamplingParams,
                     sink: Callable[[RequestOutput], None], request_id: str | None = None,
                     room: int | None = None, cache_salt: bytes | None = None,
                     prefill_agent: str | None = None) -> Request:
        check_request(self.runner.model.cfg, self.max_context, prompt_ids, params)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        return Request(request_id or uuid.uuid4().hex, prompt_ids, params, sink, detok, room, cache_salt, prefill_agent)

    def submit(self, req: Request) -> None:
        self.scheduler.submit(req)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 sink: Callable[[RequestOutput], None], request_id: str | None = None,
                 room: int | None = None, cache_salt: bytes | None = None,
                 prefill_agent: str | None = None) -> str:
        """Queue a request; outputs go to `sink` from the engine thread. Returns its id."""
        req = self.make_request(prompt_ids, params, sink, request_id, room, cache_salt, prefill_agent)
        self.submit(req)
        return req.id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def stats(self) -> dict:
        return self.scheduler.stats()

    def identity(self) -> dict:
        """Who answers here (the `describe` control request): the role, and a prefill engine's agent."""
        return {"role": self.cfg.role, **self.scheduler.role.identity()}

    def describe(self) -> str:
        runner = self.runner
        weights = f"{runner.model.weight_dtype} weights" if runner.model.linear.name != "panel-int8" else "int8 weights"
        return (f"{self.cfg.model_path}, {runner.device}, {weights} ({runner.model.linear.name}), {runner.dtype} "
                f"activations, attention {runner.attention_backend}, "
                f"{runner.pool.num_pages} KV pages of {self.cfg.page_size} tokens")

    # ---- the loop thread -----------------------------------------------------------
    def start(self) -> "Engine":
        # Everything loaded so far (tokenizer, weights, torch and Triton modules) lives as long as
        # the engine: out of the collector's reach, a full collection no longer walks it.
        gc.freeze()
        # Frozen objects are never collected, not even at exit, so nanobind (under triton, which
        # torch imports) would report each of them as "leaked" - a thousand lines after the last
        # output. Handing them back to the collector at exit lets the interpreter free them.
        atexit.unregister(gc.unfreeze)
        atexit.register(gc.unfreeze)
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.scheduler.step()
            except Exception:  # keep serving; the step already failed its own requests
                log.exception("engine step failed")

    def stop(self) -> None:
        self._stop.set()
        self.scheduler.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.scheduler.close()
        self.scheduler.role.close()
