"""Incremental detokenization that streams the way vLLM does.

Each new token's text is the difference between decoding a short window that
ends with it and the same window without it. The window starts in the prompt,
so the leading space a SentencePiece tokenizer folds into the first new token
is kept, and a token that ends inside a multi-byte character waits (its text
would end in U+FFFD) until the character is complete. The final piece flushes
what is still waiting as the tokenizer decodes it (U+FFFD for a cut character,
as `tokenizer.decode(ids)` shows it), so the pieces always add up to the full
decode. Stop strings are cut off, and text that could be the start of a stop
string is held back until it cannot be.
"""
from __future__ import annotations

PROMPT_CONTEXT = 6  # prompt tokens the first window starts with


def fast_decoder(tokenizer):
    """The Rust tokenizer's decode when it gives the same text as tokenizer.decode, else None.

    A fast tokenizer's decode is the Rust decode plus, only when
    clean_up_tokenization_spaces is set, a Python clean-up pass; calling the Rust
    one directly skips ~20 us of wrapper per call (two calls per token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False) \
            or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False):
        self.tokenizer = tokenizer
        self._backend_decode = fast_decoder(tokenizer)
        self.skip_special = skip_special_tokens
        self.include_stop = include_stop   # a stop string stays in the text (vLLM's include_stop_str_in_output)
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""      # output text so far, cut at a stop string
        self.sent = 0       # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: list[int], skip_special: bool | None = None) -> str:
        skip = self.skip_special if skip_special is None else skip_special
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip)
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens kept: vLLM's `decoded_token` of a logprob."""
        return self._decode([token_id], skip_special=False)

    def add(self, token_id: int) -> None:
        """Account for one new token; sets `stopped` when a stop string appears."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # no complete character yet
        start = len(self.text)
        self.text += after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        for s in self.stop:
            idx = self.text.find(s, max(0, start - len(s) + 1))
            if idx != -1:
                self.text = self.text[:idx + len(s) if self.include_stop else idx]
                self.stopped = True

    def flush(self) -> None:
        """The text of tokens still waiting for the rest of their character, as decode shows it."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before):
            start = len(self.text)
            self.text += after[len(before):]
            self._find_stop(start)
        self.prefix_offset = self.read_offset = len(self.ids)

    def take(self, final: bool, flush: bool = True) -> str:
        """New text that is safe to stream; everything left when `final` (flushed unless told not to:
        the prefill half of a hand-off is not the end of the text)."""
        if final and flush:
            self.flush()
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent:end], end
        return piece
