#!/usr/bin/env python3
"""What KV events and the dashboard cost `kvforge serve` (issue 47).

Two arms, interleaved, ROUNDS rounds each, a fresh server per run:
  off: `kvforge-serve` as it is;
  on:  `--kv-events`, with 25 subscribers on /v1/kv_events and 25 on
       /dashboard/stream reading everything, and one /v1/kv_events
       subscriber that never reads (a tiny receive buffer).
The same load in each: CLIENTS concurrent clients, each sending REQUESTS
chat requests one after another (distinct prompts over a shared start,
greedy, MAX_TOKENS tokens, ignore_eos), so that every request stores its
blocks in the prefix cache (one batch of events each).

Prints, per arm, the median over rounds of generated tokens per second of
wall time and the server's RSS (idle after start, and after the load), and
writes them to OUT/report.md. Standard library only; run from the
repository root after `cargo build --release -p kvforge-server`:

    .venv/bin/python scripts/events_overhead.py [--rounds 3] [--out target/events-overhead]
"""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import threading
import time

SERVE = "target/release/kvforge-serve"
MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
KEY = "overhead"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def start(port, events):
    args = [SERVE, "--model", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    if events:
        # Events need keys; both arms take the same one.
        args.append("--kv-events")
    args += ["--api-key", KEY]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p
        except OSError:
            pass
        time.sleep(0.1)
    p.kill()
    raise SystemExit("the server did not come up")


def reader(port, path, stop):
    """A subscriber that reads everything until stopped or the server goes
    (blocking reads: a socket that timed out once cannot be read again)."""
    c = http.client.HTTPConnection("127.0.0.1", port)
    c.request("GET", path, headers=AUTH)
    r = c.getresponse()
    try:
        while not stop.is_set() and r.read1(65536):
            pass
    except OSError:
        pass
    c.close()


def never_reads(port):
    """A subscriber that sends its request and never reads the reply."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET /v1/kv_events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    return s


def client(port, cid, requests, max_tokens, out):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for t in range(requests):
        body = {
            "model": MODEL_ID,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant who answers briefly."},
                {"role": "user", "content": f"Client {cid}, question {t}: what does a KV cache keep, and why?"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json", **AUTH})
        r = c.getresponse()
        v = json.loads(r.read())
        if r.status != 200:
            raise SystemExit(f"request failed: {v}")
        out.append(v["usage"]["completion_tokens"])


def run(events, a):
    port = free_port()
    p = start(port, events)
    stop = threading.Event()
    subs, quiet = [], None
    try:
        idle = rss_kib(p.pid)
        if events:
            for i in range(a.subscribers):
                path = "/v1/kv_events" if i % 2 == 0 else "/dashboard/stream"
                t = threading.Thread(target=reader, args=(port, path, stop), daemon=True)
                t.start()
                subs.append(t)
            if a.never_reader:
                quiet = never_reads(port)
            time.sleep(1.0)
        tokens = []
        t0 = time.monotonic()
        threads = [
            threading.Thread(target=client, args=(port, c, a.requests, a.max_tokens, tokens))
            for c in range(a.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        after = rss_kib(p.pid)
        return sum(tokens) / wall, idle, after
    finally:
        stop.set()
        if quiet:
            quiet.close()
        p.terminate()
        p.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--subscribers", type=int, default=50, help="reading subscribers in the on arm, half on each stream")
    ap.add_argument("--never-reader", type=int, default=1, help="1: one subscriber that never reads, in the on arm")
    ap.add_argument("--out", default="target/events-overhead")
    a = ap.parse_args()
    if not os.path.exists(SERVE):
        raise SystemExit(f"{SERVE} missing: cargo build --release -p kvforge-server")
    rows = {"off": [], "on": []}
    for r in range(a.rounds):
        for arm in ("off", "on"):
            tps, idle, after = run(arm == "on", a)
            rows[arm].append((tps, idle, after))
            print(f"round {r + 1} {arm}: {tps:.1f} tok/s, RSS idle {idle / 1024:.1f} MiB, after {after / 1024:.1f} MiB", flush=True)
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in rows.items()}
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# KV events and the dashboard: what they cost kvforge serve\n",
        f"{a.clients} clients × {a.requests} chat requests of {a.max_tokens} tokens (greedy, ignore_eos), a fresh server per run, "
        f"the arms interleaved, {a.rounds} rounds; medians. `on`: `--kv-events`, 25 subscribers reading /v1/kv_events, "
        "25 reading /dashboard/stream, one /v1/kv_events subscriber that never reads.\n",
        "| arm | tokens/s | RSS idle (MiB) | RSS after the load (MiB) |",
        "|---|---:|---:|---:|",
    ]
    for k in ("off", "on"):
        tps, idle, after = med[k]
        lines.append(f"| {k} | {tps:.1f} | {idle / 1024:.1f} | {after / 1024:.1f} |")
    ratio = med["on"][0] / med["off"][0]
    lines.append(f"\non / off tokens/s: {ratio:.3f}. Every run: " + "; ".join(
        f"{k} {', '.join(f'{x[0]:.1f}' for x in v)}" for k, v in rows.items()))
    lines.append(f"\nMeasured at commit `{commit}` by `scripts/events_overhead.py --rounds {a.rounds}`.")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
