"""Concurrent streamed completions against an OpenAI-compatible endpoint (`tinyloop MODEL serve`
or the Ray Serve application), as an engine's users load it.

    python3 bench/openai_load.py URL --clients 64 [--prompt-len 128] [--max-tokens 256]
                                 [--vocab 50304] [--repeats 1] [--json]

Each of --clients threads sends one streamed, greedy completion of a token-id prompt
(--prompt-len pseudo-random ids below --vocab, different for every client, so that no prompt
shares cached pages with another) asking for exactly --max-tokens tokens (`return_token_ids`,
so that a chunk says how many tokens it carries), all at once. Reports, per repeat, the
aggregate generated tokens/s (every client's tokens over the wall time from the first request
sent to the last token received), time to first token and the gaps between tokens (p50 and
p99 over every request and token), and fails when a request did not complete with all its
tokens. One untimed round of short requests warms the server first. Only the standard library:
it runs wherever the server's host has a Python.
"""

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse


def prompt(client, length, vocab):
    """Pseudo-random token ids (a linear congruential sequence seeded by the client)."""
    state, ids = 1000003 * (client + 1), []
    for _ in range(length):
        state = (state * 1103515245 + 12345) % 2**31
        ids.append(state % vocab)
    return ids


def stream(url, body, timeout_s):
    """Send one streamed completion; returns (arrival time of each token, finish reason)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("POST", parts.path.rstrip("/") + "/v1/completions", json.dumps(body),
                     {"content-type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        arrivals, finish = [], None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            choice = chunk["choices"][0]
            now = time.perf_counter()
            arrivals.extend([now] * len(choice.get("token_ids") or []))
            finish = choice.get("finish_reason") or finish
        return arrivals, finish
    finally:
        conn.close()


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run(url, clients, prompt_len, max_tokens, vocab, timeout_s, round_index):
    results = [None] * clients
    bodies = [{"model": "bench", "prompt": prompt(round_index * clients + c, prompt_len, vocab),
               "max_tokens": max_tokens, "temperature": 0, "stream": True,
               "return_token_ids": True} for c in range(clients)]
    start = threading.Barrier(clients + 1)

    def client(c):
        start.wait()
        sent = time.perf_counter()
        try:
            arrivals, finish = stream(url, bodies[c], timeout_s)
            results[c] = (sent, arrivals, finish, None)
        except Exception as e:  # reported below
            results[c] = (sent, [], None, e)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout_s)
    failed = [(c, r) for c, r in enumerate(results)
              if r is None or r[3] is not None or len(r[1]) != max_tokens]
    if failed:
        c, r = failed[0]
        what = "still running" if r is None else (r[3] or f"{len(r[1])} tokens, finish {r[2]}")
        sys.exit(f"{len(failed)} of {clients} requests failed; client {c}: {what}")
    end = max(r[1][-1] for r in results)
    ttft = [(r[1][0] - r[0]) * 1e3 for r in results]
    gaps = [(b - a) * 1e3 for r in results for a, b in zip(r[1], r[1][1:])]
    return {
        "clients": clients,
        "tokens": clients * max_tokens,
        "wall_s": end - t0,
        "tokens_per_s": clients * max_tokens / (end - t0),
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
        "itl_ms": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99)},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256, help="prompt ids are below this")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600, help="seconds a request may take")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if min(args.clients, args.prompt_len, args.max_tokens, args.vocab, args.repeats) < 1:
        sys.exit("--clients, --prompt-len, --max-tokens, --vocab and --repeats must be >= 1")
    run(args.url, min(args.clients, 8), 8, 4, args.vocab, args.timeout, args.repeats)
    rounds = [run(args.url, args.clients, args.prompt_len, args.max_tokens, args.vocab,
                  args.timeout, r) for r in range(args.repeats)]
    summary = {"url": args.url, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
               "rounds": rounds,
               "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds)}
    if args.json:
        print(json.dumps(summary))
        return
    for r in rounds:
        print(f"{r['clients']} clients: {r['tokens_per_s']:.0f} tokens/s "
              f"(TTFT p50 {r['ttft_ms']['p50']:.1f} ms, p99 {r['ttft_ms']['p99']:.1f}; "
              f"ITL p50 {r['itl_ms']['p50']:.2f} ms, p99 {r['itl_ms']['p99']:.2f})")


if __name__ == "__main__":
    main()
