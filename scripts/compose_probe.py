#!/usr/bin/env python3
"""The HTTP checks of scripts/compose_check.sh, in the standard library only (it runs on
the Docker host, where the project need not be installed).

    compose_probe.py chat URL KEYFILE [--requests N] [--max-tokens N] [--question TEXT]
        N chat completions at once through the OpenAI-compatible API; prints each one's
        status, time and answer; exit 1 unless every one answered 200 with its tokens and
        all answered alike (greedy).
    compose_probe.py targets PROMETHEUS_URL [--wait S] [--expect N]
        waits until Prometheus has N active targets, all up; prints them.
    compose_probe.py queries PROMETHEUS_URL DASHBOARD_JSON
        runs every query of the Grafana dashboard against Prometheus (its variables
        replaced by match-all values); exit 1 if any is refused.
    compose_probe.py metric PROMETHEUS_URL EXPR
        prints the value of one instant query (one series), or nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

QUESTION = "What is the capital of France? Answer in one sentence."


def _get(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def chat(args: argparse.Namespace) -> int:
    key = open(args.keyfile).read().strip()
    results: list[tuple[int, float, str]] = [(0, 0.0, "")] * args.requests

    def one(i: int) -> None:
        body = json.dumps({"model": "smollm2-135m", "max_tokens": args.max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": args.question}]}).encode()
        req = urllib.request.Request(f"{args.url}/v1/chat/completions", body, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=args.timeout) as r:
                reply = json.loads(r.read())
            text = reply["choices"][0]["message"]["content"]
            ok = reply["usage"]["completion_tokens"] > 0
            results[i] = (200 if ok else 299, time.monotonic() - t0, text)
        except urllib.error.HTTPError as exc:
            results[i] = (exc.code, time.monotonic() - t0, exc.read().decode(errors="replace")[:200])
        except Exception as exc:  # noqa: BLE001 - reported
            results[i] = (-1, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.requests)]
    for t in threads:
        t.start()
        time.sleep(args.stagger)
    for t in threads:
        t.join()
    for i, (status, seconds, text) in enumerate(results):
        print(f"request {i}: {status} in {seconds:.1f} s: {text.strip()[:100]!r}")
    answers = {text for status, _, text in results if status == 200}
    if len(answers) > 1:
        print(f"{len(answers)} different answers to one greedy question")
        return 1
    return 0 if all(status == 200 for status, _, _ in results) else 1


def targets(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    while True:
        try:
            active = _get(f"{args.url}/api/v1/targets")["data"]["activeTargets"]
        except OSError as exc:
            active, error = [], str(exc)
        else:
            error = ""
        up = [t for t in active if t["health"] == "up"]
        if len(active) == args.expect and len(up) == len(active):
            break
        if time.monotonic() > deadline:
            for t in active:
                print(f"{t['labels'].get('job')} {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}")
            print(f"{len(up)} of {len(active)} targets up, {args.expect} expected {error}")
            return 1
        time.sleep(2)
    for t in active:
        print(f"{t['labels'].get('job')} {t['scrapeUrl']}: up")
    return 0


def _promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced by match-all values."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "5m")
    expr = re.sub(r'(=~?)\s*"\$\{?\w+(:\w+)?\}?"', r'=~".*"', expr)
    return re.sub(r"\$\{?\w+(:\w+)?\}?", ".*", expr)


def queries(args: argparse.Namespace) -> int:
    dashboard = json.load(open(args.dashboard))
    exprs = [t["expr"] for panel in dashboard.get("panels", []) for t in panel.get("targets", []) if t.get("expr")]
    failed = 0
    for var in dashboard.get("templating", {}).get("list", []):
        m = re.fullmatch(r"\s*label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)\s*", var.get("definition", ""))
        if not m:
            continue
        values = _get(f"{args.url}/api/v1/label/{m.group(2)}/values?" + urllib.parse.urlencode({"match[]": m.group(1)}))
        ok = values.get("status") == "success" and bool(values["data"])
        failed += not ok
        print(f"{'ok' if ok else 'NO VALUES'}: variable ${var['name']} = {values['data']}")
    for expr in exprs:
        q = _promql(expr)
        try:
            reply = _get(f"{args.url}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
            ok, detail = reply.get("status") == "success", f"{len(reply['data']['result'])} series"
        except urllib.error.HTTPError as exc:
            ok, detail = False, exc.read().decode(errors="replace")[:200]
        failed += not ok
        print(f"{'ok' if ok else 'REFUSED'}: {detail}: {q}")
    print(f"{len(exprs) - failed} of {len(exprs)} dashboard queries answered")
    return 1 if failed or not exprs else 0


def metric(args: argparse.Namespace) -> int:
    result = _get(f"{args.url}/api/v1/query?" + urllib.parse.urlencode({"query": args.expr}))["data"]["result"]
    if result:
        print(result[0]["value"][1])
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("chat")
    c.add_argument("url")
    c.add_argument("keyfile")
    c.add_argument("--requests", type=int, default=1)
    c.add_argument("--max-tokens", type=int, default=24)
    c.add_argument("--stagger", type=float, default=0.0, help="seconds between the requests' starts")
    c.add_argument("--question", default=QUESTION, help="the user message (default: a fixed question)")
    c.add_argument("--timeout", type=float, default=300.0)
    c.set_defaults(fn=chat)
    t = sub.add_parser("targets")
    t.add_argument("url")
    t.add_argument("--wait", type=float, default=120.0)
    t.add_argument("--expect", type=int, required=True)
    t.set_defaults(fn=targets)
    q = sub.add_parser("queries")
    q.add_argument("url")
    q.add_argument("dashboard")
    q.set_defaults(fn=queries)
    m = sub.add_parser("metric")
    m.add_argument("url")
    m.add_argument("expr")
    m.set_defaults(fn=metric)
    args = p.parse_args()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
