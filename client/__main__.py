"""python -m client PROMPT...: stream an answer from a running Tandem server over gRPC."""
from __future__ import annotations

import argparse
import sys

from client.stream import build_inputs, stream_events


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    ap.add_argument("prompt", nargs="+", help="the prompt (words are joined with spaces)")
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default %(default)s)")
    ap.add_argument("--model", default="llm", help="llm (colocated) or router (disaggregated)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    args = ap.parse_args(argv)
    inputs = build_inputs(" ".join(args.prompt), max_tokens=args.max_tokens, stream=True,
                          chat=not args.raw, temperature=args.temperature, stop=args.stop)
    try:
        for error, outputs in stream_events(args.url, args.model, inputs):
            if error:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            sys.stdout.write(outputs["text_output"][0].decode("utf-8"))
            sys.stdout.flush()
    except Exception as exc:  # connection refused, timeout
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
