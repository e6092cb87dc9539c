"""An OpenAI-compatible HTTP service in front of a running tritonserver (`llm`, `router`)."""
