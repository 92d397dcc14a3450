#!/usr/bin/env python3
"""What does the quickstart learn with no cost flag? Serves scripts/serve_vllm.sh (the README's
block), sends 128 requests (prompts of 24-423 tokens, 64-191 new tokens, 16 at a time, half
greedy), stops it with Ctrl-C and prints each rank's `final` record: steps, exchanges and the
learnt step terms (docs/live_vllm.md, "Step costs learned online").

    ~/.cache/dpb-vllm/venv/bin/python scripts/studies/quickstart_terms.py
"""
import asyncio
import json
import os
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import vllm_serve_test as serve  # noqa: E402  (its Server runs scripts/serve_vllm.sh --no-install)


async def traffic(port: int, model: str, n: int, concurrency: int) -> None:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await client.completions.create(model=model, prompt=serve.prompt(i, 24 + (i * 53) % 400),
                                            max_tokens=64 + (i * 29) % 128,
                                            temperature=0.0 if i % 2 else 0.8)
    await asyncio.gather(*[one(i) for i in range(n)])
    await client.close()


def main() -> int:
    if len(sys.argv) > 1:
        print(__doc__)
        return 0
    s = serve.Server("quickstart", tempfile.mkdtemp(prefix="dpb-qs-"), {})
    if not s.wait_healthy():
        print(s.text()[-3000:])
        return 1
    asyncio.run(traffic(s.port, s.model, 128, 16))
    s.stop()
    for rank in (0, 1):
        final = [x["final"] for x in s.step_rows(rank) if "final" in x]
        if final:
            print(json.dumps({k: final[-1].get(k) for k in
                              ("dp_rank", "steps", "exchanges", "balanced_steps", "step_terms")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
