"""Chat messages as the prompt text the model tokenizes, by the checkpoint's chat template."""
from __future__ import annotations

from client.openai_server.errors import bad_request
from client.openai_server.protocol import ChatMessage


class ChatTemplate:
    def __init__(self, tokenizer_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        if not self.tokenizer.chat_template:
            raise ValueError(f"the tokenizer at {tokenizer_path} has no chat template")
        # The model tokenizes text_input with its special tokens added; where that adds a BOS,
        # a template that writes one itself would get two. Rendered text loses its BOS then,
        # so the model's ids equal apply_chat_template(..., tokenize=True)'s.
        bos = self.tokenizer.bos_token
        adds_bos = bos is not None and self.tokenizer("x").input_ids[:1] == [self.tokenizer.bos_token_id]
        self.strip = bos if adds_bos else None

    def render(self, messages: list[ChatMessage]) -> str:
        conversation = [{"role": m.role, "content": _text(m.content)} | ({"name": m.name} if m.name else {})
                        for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (jinja raise_exception), e.g. role order
            raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
        if self.strip and text.startswith(self.strip):
            text = text[len(self.strip):]
        return text


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)
