"""`python -m ddptrain.generate`: continue prompts with a trained model through the serving path
(ddptrain.generation's continuous batching, one decoding loop)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from ddptrain.generation.generator import (Generator, ModelLoadError, RequestError, SamplingParams, check_text,
                                           quiet_transformers)

SEPARATOR = "-" * 40
"""Printed between the samples."""


async def _generate(args) -> int:
    from ddptrain.serving.servable import servable_dir

    generator = Generator(servable_dir(args.path), max_active=len(args.prompt), device=args.device)
    requests = []
    for prompt in args.prompt:
        check_text(prompt, "--prompt")
        max_tokens = args.max_tokens
        if max_tokens is None:  # as many as fit, at most 256
            fits = generator.context - len(generator.tokenizer.encode(prompt).ids) if generator.context else 256
            max_tokens = max(1, min(256, fits))
        params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, stop=tuple(args.stop))
        requests.append((generator.prepare(prompt, params), params))
    generator.start()
    try:
        completions = [generator.submit(ids, params, stream=False) for ids, params in requests]  # decoded together
        texts = await asyncio.gather(*(c.text() for c in completions))
    finally:
        generator.close()
    for index, (prompt, text) in enumerate(zip(args.prompt, texts)):
        if index:
            print(SEPARATOR)
        print(prompt + text)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ddptrain.generate",
        description="Continue prompts with a trained model (the serving path: continuous batching, one loop).")
    parser.add_argument("path", help="a ddptrain run directory or a transformers model directory")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens to generate per prompt (default: as many as the context holds, at most 256)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy; at most 2")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    parser.add_argument("--seed", type=int, default=None, help="seed of each prompt's sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop before this string (repeatable)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    args = parser.parse_args(argv)
    from ddptrain.serving.servable import ServableError

    quiet_transformers()
    try:
        sys.exit(asyncio.run(_generate(args)))
    except RequestError as error:
        print(f"generate error: {error}", file=sys.stderr)
        sys.exit(2)
    except (ServableError, ModelLoadError, FileNotFoundError, ValueError) as error:
        print(f"generate error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
