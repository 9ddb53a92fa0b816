"""TinyLoop on Ray Serve, measured through its OpenAI endpoint on a local Ray cluster
(docs/PERF.md "Scale-out (CPU)").

throughput: aggregate generated tokens/s of N concurrent clients against 1 and 2 engine
replicas of one thread each (and 1 replica of 2 threads: the same cores used by one engine);
each client sends its requests one after another, greedy, distinct short prompts.

prefix: the share of prompt tokens taken from cached KV pages (the responses' usage
``prompt_tokens_details.cached_tokens``) on a workload of shared system prompts, routed by
prefix and by power of two choices (Ray's default, which does not look at prompts), 2 replicas.

    pip install "bindings/python[serve]" openai
    python bench/ray_serve_bench.py models/demo.tinyloop --json out.json

Every configuration is deployed fresh, warmed with two short requests per replica, then timed;
``--repeats`` runs of each workload give the medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import socket
import statistics
import sys
import time

import openai
import ray
from ray import serve

from tinyloop_py.serve import app

WORDS = ("the king doth wake tonight and takes his rouse keeps wassail and the swaggering "
         "upspring reels and as he drains his draughts of rhenish down the kettle-drum and "
         "trumpet thus bray out the triumph of his pledge").split()


def deploy(url, **args):
    """A fresh deployment of ``args`` (its engines' caches empty), warmed with two short
    requests per replica; returns a client for it."""
    serve.run(app(args), name="bench", route_prefix="/")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    replicas = args.get("replicas", 1)
    run_clients(client, [f"WARM {i}:" for i in range(2 * replicas)], 2 * replicas, 4)
    return client


def run_clients(client, jobs, clients, max_tokens):
    """Send ``jobs`` (prompts) from ``clients`` concurrent clients, each taking the next prompt
    when its last one ended. Returns (wall seconds, list of usage, list of latencies)."""
    queue = list(reversed(jobs))
    usages, latencies = [], []

    def worker():
        while True:
            try:
                prompt = queue.pop()
            except IndexError:
                return
            t = time.perf_counter()
            r = client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                          temperature=0)
            latencies.append(time.perf_counter() - t)
            usages.append(r.usage)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result(timeout=1800)
    return time.perf_counter() - start, usages, latencies


def throughput(url, model, args):
    rows = []
    for replicas, threads in ((1, 1), (2, 1), (1, 2)):
        client = deploy(url, model=model, replicas=replicas, threads=threads, device="cpu")
        rates = []
        for _ in range(args.repeats):
            prompts = [f"{w.upper()} {i}:" for i, w in
                       zip(range(args.clients * args.requests), WORDS * 100)]
            wall, usages, _ = run_clients(client, prompts, args.clients, args.max_tokens)
            rates.append(sum(u.completion_tokens for u in usages) / wall)
        rows.append({"replicas": replicas, "threads": threads, "tokens_per_s": rates,
                     "median": statistics.median(rates)})
        serve.delete("bench")
    return rows


def system_prompts(n, chars, seed=1):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(WORDS))
        out.append(f"SYSTEM {i}: " + " ".join(words)[:chars])
    return out


def prefix(url, model, args):
    systems = system_prompts(args.systems, args.system_chars)
    rng = random.Random(2)
    # The most a cache can give (a byte-level model, 16-token pages): every request of a system
    # prompt but its first takes the whole pages of the text it shares with the others.
    shared = [len(f"{s}\nQUESTION 0.") // 16 * 16 for s in systems]
    total = sum((len(f"{s}\nQUESTION 0.0:")) * args.per_system for s in systems)
    rows = [{"routing": "bound", "cached_share": sum(shared) * (args.per_system - 1) / total}]
    for routing in ("prefix", "pow2"):
        shares, rates, latency = [], [], []
        for repeat in range(args.repeats):
            client = deploy(url, model=model, replicas=2, threads=1, device="cpu",
                            routing=routing)
            jobs = [f"{s}\nQUESTION {repeat}.{q}:" for s in systems
                    for q in range(args.per_system)]
            rng.shuffle(jobs)
            wall, usages, latencies = run_clients(client, jobs, args.prefix_clients, 16)
            serve.delete("bench")
            latency.append(statistics.median(latencies))
            prompt = sum(u.prompt_tokens for u in usages)
            cached = sum(u.prompt_tokens_details.cached_tokens or 0 for u in usages)
            shares.append(cached / prompt)
            rates.append(len(usages) / wall)
        rows.append({"routing": routing, "cached_share": shares,
                     "median_cached_share": statistics.median(shares),
                     "requests_per_s": rates, "median_requests_per_s": statistics.median(rates),
                     "median_latency_s": statistics.median(latency)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--only", choices=["throughput", "prefix"])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=2, help="requests per client (throughput)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--systems", type=int, default=16, help="shared system prompts (prefix)")
    p.add_argument("--system-chars", type=int, default=256)
    p.add_argument("--per-system", type=int, default=4, help="requests per system prompt")
    p.add_argument("--prefix-clients", type=int, default=8, help="concurrent clients (prefix)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    model = os.path.abspath(args.model)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    out = {"cores": os.cpu_count(), "args": vars(args)}
    try:
        if args.only in (None, "throughput"):
            out["throughput"] = throughput(url, model, args)
            one = out["throughput"][0]["median"]
            for row in out["throughput"]:
                print(f"throughput: {row['replicas']} replica(s) x {row['threads']} thread(s): "
                      f"median {row['median']:.1f} tokens/s ({row['median'] / one:.2f}x), runs "
                      + ", ".join(f"{r:.1f}" for r in row["tokens_per_s"]))
        if args.only in (None, "prefix"):
            out["prefix"] = prefix(url, model, args)
            print(f"prefix workload: at most {out['prefix'][0]['cached_share']:.3f} of the prompt "
                  "tokens can come from a cache")
            for row in out["prefix"][1:]:
                print(f"prefix workload, routing {row['routing']}: median cached share "
                      f"{row['median_cached_share']:.3f} (runs "
                      + ", ".join(f"{s:.3f}" for s in row["cached_share"])
                      + f"), median {row['median_requests_per_s']:.2f} requests/s, median "
                      f"latency {row['median_latency_s']:.2f} s")
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
