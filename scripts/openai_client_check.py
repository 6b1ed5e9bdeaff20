#!/usr/bin/env python3
"""Talks to a running `molt-run serve` with the official `openai` Python package, as any
OpenAI client would, and checks Molt's promises on the wire:

1. the server lists its model;
2. a streamed chat completion parses chunk by chunk with the stock client, and every token
   chunk names the rung that produced it (`chunk.molt["rung"]`);
3. a memory budget cut posted *while the answer streams* (POST /v1/molt/budget, from another
   thread, after a few tokens) arrives as a `budget` event and a `switch` event of its own,
   and the tokens after it name the smaller rung;
4. the stream ends with a summary (tokens, rungs used, migrations and their cost, killed=false)
   and `[DONE]` (the client's iterator simply ends);
5. a non-streamed completion carries the same summary;
6. an invalid request raises the client's own BadRequestError with the server's JSON message.

Usage (after `pip install openai`):

    molt-run serve --port 8088 --projectors DIR &
    python3 scripts/openai_client_check.py --base-url http://127.0.0.1:8088/v1

Exit status 0 when every check passed, 1 otherwise. The budget is restored to what it was
before the run (unlimited, a fixed value or the system).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request

try:
    import openai
except ImportError:
    sys.exit("this check needs the openai package: pip install openai")


def http_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def molt_of(chunk) -> dict | None:
    """The `molt` extension object of a chunk (pydantic keeps unknown fields as extras)."""
    extra = getattr(chunk, "model_extra", None) or {}
    return extra.get("molt")


def pick_cut(status: dict, to: str | None) -> tuple[float, str]:
    """A budget (MiB) that holds rung `to` (default: the smallest) with a full context but
    not the next larger rung, so the policy must move there."""
    rungs = status["engine"]["rungs"]
    names = [r["name"] for r in rungs]
    target = to or names[-1]
    i = names.index(target)
    if i == 0:
        sys.exit(f"--cut-to {target}: that is the largest rung, nothing to switch to")
    lo = rungs[i]["full_context_mib"]
    hi = rungs[i - 1]["resident_mib"]
    if lo >= hi:
        # The rungs overlap with a full context; hold the target for a quarter context.
        lo = rungs[i]["resident_mib"] + rungs[i]["kv_bytes_per_token"] * status["engine"]["n_ctx"] / 4 / 2**20
    return (lo + hi) / 2, target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8088/v1")
    ap.add_argument("--prompt", default="Write a Python function that merges two sorted lists, and explain how it works.")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cut-after", type=int, default=12, help="tokens streamed before the budget cut")
    ap.add_argument("--cut-to", default=None, help="rung the cut should leave room for (default: the smallest)")
    ap.add_argument("--json-out", default=None, help="write the observed events and results here")
    args = ap.parse_args()

    root = args.base_url.rstrip("/").removesuffix("/v1")
    client = openai.OpenAI(base_url=args.base_url, api_key="not-needed", timeout=600, max_retries=0)
    failures: list[str] = []

    def check(cond: bool, what: str) -> None:
        print(("  ok    " if cond else "  FAIL  ") + what)
        if not cond:
            failures.append(what)

    print(f"openai {openai.__version__} against {args.base_url}")
    models = client.models.list()
    model = models.data[0].id
    check(len(models.data) == 1, f"models.list() -> {model!r}")

    status = http_json(root + "/v1/molt/status")
    before = status["budget"]
    cut_mib, target = pick_cut(status, args.cut_to)
    http_json(root + "/v1/molt/budget", {"unlimited": True})
    print(f"rungs: {[r['name'] for r in status['engine']['rungs']]}, start {status['engine']['current_rung']}; "
          f"cut to {cut_mib:.0f} MiB after {args.cut_after} tokens (room for {target})")

    # --- streamed answer with a budget cut posted mid-stream --------------------------------
    events: list[dict] = []
    text = []
    cut_done = threading.Event()
    t0 = time.monotonic()
    first_token_s = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens, stream=True,
    )
    n_tokens = 0
    finish = None
    for chunk in stream:
        m = molt_of(chunk)
        if m is not None:
            events.append(m)
        if chunk.choices:
            c = chunk.choices[0]
            if c.delta and c.delta.content:
                text.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
        if m and m.get("event") == "token":
            n_tokens += 1
            if first_token_s is None:
                first_token_s = time.monotonic() - t0
            if n_tokens == args.cut_after and not cut_done.is_set():
                threading.Thread(
                    target=lambda: (http_json(root + "/v1/molt/budget", {"mib": cut_mib}), cut_done.set()),
                    daemon=True,
                ).start()
        elif m and m.get("event") in ("switch", "budget", "stall"):
            print(f"  <- {m['event']}: " + json.dumps({k: v for k, v in m.items() if k != "event"}))
    total_s = time.monotonic() - t0
    cut_done.wait(10)
    print("answer: " + "".join(text).replace("\n", "\\n")[:400])

    tokens = [e for e in events if e.get("event") == "token"]
    switches = [e for e in events if e.get("event") == "switch"]
    summary = next((e for e in events if e.get("event") == "summary"), None)
    check(len(tokens) > 0 and all("rung" in t for t in tokens), f"{len(tokens)} token chunks, each naming its rung")
    check(any(e.get("event") == "budget" for e in events), "the budget cut arrived as a budget event")
    check(len(switches) >= 1, f"{len(switches)} switch event(s)")
    if switches:
        sw = switches[0]
        at = sw["at_token"]
        print(f"  switch {sw['from']} -> {sw['to']} ({sw['method']}) before token {at}: cost {sw['cost_ms']:.1f} ms "
              f"(+ load {sw['load_ms']:.0f} ms), FLOPs avoided {sw['flops_avoided']:.3g} "
              f"({100 * sw['flops_avoided_fraction']:.1f}%), pressure {sw['pressure']:.2f}, budget {sw['budget_mib']:.0f} MiB")
        before_sw = {t["rung"] for t in tokens if t["index"] < at}
        after_sw = {t["rung"] for t in tokens if t["index"] >= at}
        check(before_sw == {sw["from"]} and after_sw <= {sw["to"]} and after_sw,
              f"tokens before the switch on {sorted(before_sw)}, after it on {sorted(after_sw)}")
    check(summary is not None, "a summary event closes the stream")
    if summary:
        print(f"  summary: {summary['tokens']} tokens, rungs {summary['rungs_used']}, {summary['migrations']} migration(s) "
              f"costing {summary['migration_cost_ms']:.1f} ms, ttft {summary['ttft_ms']:.0f} ms, "
              f"total {summary['total_ms']:.0f} ms, stop {summary['stop']}, killed {summary['killed']}")
        check(summary["killed"] is False, "killed = false")
        check(summary["tokens"] == len(tokens), "summary token count matches the chunks")
    check(finish in ("stop", "length"), f"finish_reason {finish!r}")
    print(f"  client-side: first token after {first_token_s or 0:.2f} s, stream {total_s:.2f} s")

    # --- non-streamed answer ----------------------------------------------------------------
    http_json(root + "/v1/molt/budget", {"unlimited": True})
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello in five words."}], max_tokens=16,
    )
    m = (r.model_extra or {}).get("molt") or {}
    check(bool(r.choices[0].message.content), f"non-streamed: {r.choices[0].message.content!r}")
    check("rungs_used" in m and m.get("killed") is False, f"non-streamed summary: rungs {m.get('rungs_used')}")

    # --- an invalid request -----------------------------------------------------------------
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2)
        check(False, "n=2 is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"n=2 -> BadRequestError 400: {e.body.get('message') if isinstance(e.body, dict) else e.body}")

    # Restore the budget the server had.
    restore = {"unlimited": True}
    if before["mode"] == "fixed" and before.get("budget_mib"):
        restore = {"mib": before["budget_mib"]}
    elif before["mode"] == "system":
        restore = {"system": True}
    http_json(root + "/v1/molt/budget", restore)

    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"openai_version": openai.__version__, "model": model, "cut_mib": cut_mib,
                       "events": [e for e in events if e.get("event") != "token"],
                       "tokens": tokens, "text": "".join(text), "failures": failures}, f, indent=1)
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
