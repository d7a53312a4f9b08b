"""Serving throughput and time to first token: `ddptrain.serve` beside bare `transformers serve`.

    python -m benchmarks.bench_serve                 # trains a short default-GPT run first
    python -m benchmarks.bench_serve RUN_DIR         # or serves this run (or a transformers directory)

For 1, 4, 16 and 64 concurrent clients (each sends its requests one after another), both servers
answer the same streamed greedy /v1/completions requests (prompts of different lengths, the same
max_tokens; the model has no end-of-sequence token, so every answer has max_tokens tokens). The
table gives generated tokens per second, the ratio to one client (one request at a time), and
the median and 90th percentile time to first token. Both servers run side by side with the same
threads and the same KV cache size (--cb-num-blocks, --cb-max-batch-tokens) and take turns (ABBA
order, in rounds); the report is the median over rounds, ratios taken within a round. Each line
also says whether the texts were identical to the one-client answers and to the other server's.
A figure, not a test: these machines are shared and noisy.

    python -m benchmarks.bench_serve --huge-request-mb 20 [RUN_DIR]

instead times what a request over --max-request-mb costs the others: the median latency of small
completions alone and beside a request of that many MB, and how long that request waits for its 400.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    from ddptrain.testing import free_port

    return free_port()


def train_default_run(run_dir: Path) -> None:
    """A short run of the default GPT (4 layers, 128 wide, 256-token context): throughput does not
    depend on how well it is trained."""
    args = [sys.executable, "-m", "ddptrain", f"run.dir={run_dir}", "trainer.max_steps=20", "data.max_docs=40",
            "trainer.eval_examples=8", "trainer.log_every=20", "optim.warmup_steps=2"]
    subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True, timeout=900)


def prompts_of(count: int, context: int, max_tokens: int) -> list[str]:
    """`count` prompts of 8 to ~80 bytes cut from the standard library, all fitting the context."""
    import inspect
    import json as json_module

    source = inspect.getsource(json_module)
    longest = min(80, context - max_tokens - 1)
    prompts = []
    for index in range(count):
        length = 8 + (index * 37) % max(longest - 8, 1)
        start = (index * 997) % (len(source) - length)
        prompts.append(source[start:start + length].encode("ascii", "replace").decode())
    return prompts


class Server:
    """A server subprocess on 127.0.0.1:port, stopped on exit."""

    def __init__(self, command: list[str], port: int, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"

    def wait_healthy(self, timeout_s: float = 180) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log.read().decode()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.url} not healthy after {timeout_s}s")

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


async def one_request(client, url: str, prompt: str, max_tokens: int) -> tuple[str, int, float, float]:
    """(text, completion tokens, seconds to first text, seconds in all) of one streamed request."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    began = time.perf_counter()
    first, pieces, tokens = None, [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            text = chunk["choices"][0].get("text") or ""
            if text:
                first = first or time.perf_counter() - began
                pieces.append(text)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(pieces), tokens, first or float("nan"), time.perf_counter() - began


async def load(url: str, clients: int, prompts: list[str], max_tokens: int) -> dict:
    """`clients` clients share the prompts; each sends its requests one after another."""
    import httpx

    results: dict[int, tuple] = {}

    async def client_loop(client, index: int) -> None:
        for number in range(index, len(prompts), clients):
            results[number] = await one_request(client, url, prompts[number], max_tokens)

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        began = time.perf_counter()
        await asyncio.gather(*(client_loop(client, index) for index in range(clients)))
        wall = time.perf_counter() - began
    ttft = sorted(r[2] for r in results.values())
    return {"texts": [results[i][0] for i in range(len(prompts))],
            "tokens_per_s": sum(r[1] for r in results.values()) / wall,
            "ttft_p50": statistics.median(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))], "wall_s": wall}


def measure(servers: dict, args, prompts_by_clients: dict) -> dict:
    """servers: name -> Server. Rounds of every client count, the servers alternating (ABBA) so that
    machine noise hits both alike; returns name -> clients -> list of one load() per round."""
    for server in servers.values():
        server.wait_healthy()
        asyncio.run(load(server.url, 2, prompts_by_clients[args.clients[0]][:4], args.max_tokens))  # warm up
    rows = {name: {clients: [] for clients in args.clients} for name in servers}
    names = list(servers)
    for round_index in range(args.rounds):
        for clients in args.clients:
            for name in (names if round_index % 2 == 0 else names[::-1]):
                result = asyncio.run(load(servers[name].url, clients, prompts_by_clients[clients], args.max_tokens))
                rows[name][clients].append(result)
                print(f"  round {round_index + 1}, {name}, {clients} client(s): {result['tokens_per_s']:.0f} tokens/s",
                      flush=True)
    return rows


async def huge_request_figures(url: str, megabytes: float, count: int = 24) -> dict:
    """Median latency (s) of `count` small completions alone and beside one request of `megabytes` MB,
    and the seconds that request waited for its 400."""
    import httpx

    small = {"prompt": "def main(", "max_tokens": 4, "temperature": 0}
    huge = json.dumps({"prompt": "x" * int(megabytes * 1e6), "max_tokens": 4})

    async def timed(client, **request) -> tuple[int, float]:
        started = time.perf_counter()
        response = await client.post(url + "/v1/completions", **request)
        return response.status_code, time.perf_counter() - started

    async with httpx.AsyncClient(timeout=120) as client, httpx.AsyncClient(timeout=120) as other:
        for _ in range(4):  # warm up
            await timed(client, json=small)
        alone = [(await timed(client, json=small))[1] for _ in range(count)]

        async def small_ones() -> list[float]:
            return [(await timed(client, json=small))[1] for _ in range(count)]

        beside, (status, refused_s) = await asyncio.gather(
            small_ones(), timed(other, content=huge, headers={"content-type": "application/json"}))
    return {"alone": statistics.median(alone), "beside": statistics.median(beside), "status": status,
            "refused_s": refused_s}


def huge_request_main(directory: Path, megabytes: float, threads: int) -> None:
    port = _free_port()
    with Server([sys.executable, "-m", "ddptrain.serve", str(directory), "--port", str(port), "--device", "cpu"],
                port, threads) as server:
        server.wait_healthy()
        figures = asyncio.run(huge_request_figures(server.url, megabytes))
    print(f"small completions (4 tokens): median {figures['alone'] * 1e3:.1f} ms alone, "
          f"{figures['beside'] * 1e3:.1f} ms beside a {megabytes:g} MB request "
          f"({figures['beside'] / figures['alone']:.2f}x); that request got its {figures['status']} in "
          f"{figures['refused_s'] * 1e3:.0f} ms")


def summary(runs: list[dict], alone: list[dict]) -> dict:
    """Medians over rounds; the ratio to one client is taken within each round, then its median."""
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "ratio": statistics.median(r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(runs, alone)),
            "ttft_p50": statistics.median(r["ttft_p50"] for r in runs),
            "ttft_p90": statistics.median(r["ttft_p90"] for r in runs),
            "texts": [r["texts"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", help="run directory or transformers directory (default: train one)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-client", type=int, default=4,
                        help="requests each client sends (one client: 16 requests at least)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all client counts (medians are reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    parser.add_argument("--skip-transformers", action="store_true", help="only ddptrain.serve")
    parser.add_argument("--huge-request-mb", type=float, default=None,
                        help="instead: small requests' latency alone and beside one request of this many MB")
    args = parser.parse_args()

    from ddptrain.serving.servable import servable_dir

    workdir = Path(tempfile.mkdtemp(prefix="bench_serve."))
    run = Path(args.path) if args.path else workdir / "run"
    if not args.path:
        print(f"training a short default-GPT run in {run} ...", flush=True)
        train_default_run(run)
    directory = servable_dir(run)
    if args.huge_request_mb is not None:
        return huge_request_main(directory, args.huge_request_mb, args.threads)
    config = json.loads((directory / "config.json").read_text())
    context = config.get("n_positions") or config.get("max_position_embeddings")
    max_active = max(args.clients)
    prompts_by_clients = {c: prompts_of(max(c * args.requests_per_client, 16), context, args.max_tokens)
                          for c in args.clients}

    # The KV cache ddptrain.serve sizes for max_active full-context sequences, given to both servers.
    from ddptrain.generation.generator import Generator

    cache = Generator(directory, max_active=max_active, device="cpu")._cache_config()
    print(f"model {directory} (context {context}), {args.max_tokens} tokens per request, {args.threads} thread(s) "
          f"per server; KV cache: {cache.num_blocks} blocks of {cache.page_size} tokens, "
          f"{cache.max_batch_tokens} tokens per batch; {args.rounds} rounds", flush=True)
    commands = {"ddptrain.serve": lambda port: [
        sys.executable, "-m", "ddptrain.serve", str(directory), "--port", str(port), "--max-active", str(max_active),
        "--device", "cpu"]}
    if not args.skip_transformers:
        commands["transformers serve"] = lambda port: [
            sys.executable, "-m", "transformers.cli.transformers", "serve", str(directory), "--continuous-batching",
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--cb-num-blocks", str(cache.num_blocks),
            "--cb-block-size", str(cache.page_size), "--cb-max-batch-tokens", str(cache.max_batch_tokens)]
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, command in commands.items():
            port = _free_port()
            servers[name] = stack.enter_context(Server(command(port), port, args.threads))
        rows = measure(servers, args, prompts_by_clients)

    base = args.clients[0]
    table = {name: {c: summary(rows[name][c], rows[name][base]) for c in args.clients} for name in rows}
    ours, theirs = table["ddptrain.serve"], table.get("transformers serve")
    print(f"\nmedians over {args.rounds} rounds; 'x 1 client': throughput over one request at a time")
    header = f"{'clients':>7} | {'ddptrain.serve tok/s':>20} {'x 1 client':>10} {'TTFT p50/p90 ms':>16} | "
    if theirs:
        header += (f"{'transformers serve tok/s':>24} {'x 1 client':>10} {'TTFT p50/p90 ms':>16} | "
                   f"{'ours/theirs':>11} | same text")
    print(header)
    reference = ours[base]["texts"][0][:16]
    for clients in args.clients:
        row = ours[clients]
        same_as_alone = all(texts[:16] == reference for texts in row["texts"])
        line = (f"{clients:>7} | {row['tokens_per_s']:>20.0f} {row['ratio']:>10.2f} "
                f"{row['ttft_p50'] * 1e3:>7.0f}/{row['ttft_p90'] * 1e3:<8.0f} | ")
        if theirs:
            other = theirs[clients]
            per_round = statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                          for a, b in zip(rows["ddptrain.serve"][clients],
                                                          rows["transformers serve"][clients]))
            line += (f"{other['tokens_per_s']:>24.0f} {other['ratio']:>10.2f} "
                     f"{other['ttft_p50'] * 1e3:>7.0f}/{other['ttft_p90'] * 1e3:<8.0f} | {per_round:>11.2f} | "
                     f"{'yes' if same_as_alone else 'NO'} (vs 1 client), "
                     f"{'yes' if row['texts'] == other['texts'] else 'NO'} (vs transformers)")
        else:
            line += f"{'yes' if same_as_alone else 'NO'} (vs 1 client)"
        print(line)


if __name__ == "__main__":
    main()
