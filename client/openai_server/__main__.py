"""python -m client.openai_server: the OpenAI API (/v1/models, /v1/completions,
/v1/chat/completions) in front of a tritonserver serving Tandem's `llm` and/or `router`."""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TOKENIZER = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client.openai_server", description=__doc__)
    ap.add_argument("--url", default="localhost:8001", help="tritonserver gRPC address (default %(default)s)")
    ap.add_argument("--host", default="0.0.0.0", help="address to listen on (default %(default)s)")
    ap.add_argument("--port", type=int, default=9000, help="port to listen on (default %(default)s)")
    ap.add_argument("--tokenizer", default=os.environ.get("TANDEM_MODEL_PATH") or DEFAULT_TOKENIZER,
                    help="checkpoint directory whose chat template and generation defaults are used "
                         "(default: $TANDEM_MODEL_PATH, else the default model)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)

    import uvicorn

    from client.openai_server.app import create_app

    try:
        app = create_app(args.url, args.tokenizer)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
