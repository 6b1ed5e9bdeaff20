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
6. an invalid request raises the client's own BadRequestError with the server's JSON message;
7. the fields clients send: the streamed answer of (3) asks for `logprobs` and every token's
   entry names the same rung as its chunk, across the switch; `stop` ends an answer before the
   stop string, streamed and not, without sending any part of it; the same `seed` samples the
   same answer; `response_format: json_object` gives JSON; `max_completion_tokens`, penalties
   and `user` are accepted; `/v1/completions` answers plain prompts, streamed and not.

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


def fields_checks(client, model: str, check) -> None:
    """Stop, logprobs, seed, json_object, token limits, penalties, user, /v1/completions."""
    ask = [{"role": "user", "content": "List three fruits, one per line, then say why you like each."}]
    base = client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0)
    full = base.choices[0].message.content or ""
    # A stop string from the middle of the greedy answer: two characters that follow the 8th.
    cut = min(8, max(len(full) - 2, 0))
    stop = full[cut:cut + 2]
    if len(stop) == 2:
        want = full[:full.find(stop)]
        r = client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0,
                                           stop=[stop, "never-seen-zzz"], user="openai-client-check")
        check(r.choices[0].message.content == want and r.choices[0].finish_reason == "stop",
              f"stop={stop!r}: {r.choices[0].message.content!r} (finish {r.choices[0].finish_reason})")
        got, fin = [], None
        for ch in client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0,
                                                 stop=stop, stream=True):
            if ch.choices and ch.choices[0].delta and ch.choices[0].delta.content:
                got.append(ch.choices[0].delta.content)
            if ch.choices and ch.choices[0].finish_reason:
                fin = ch.choices[0].finish_reason
        check("".join(got) == want and fin == "stop", f"streamed stop={stop!r}: {''.join(got)!r} (finish {fin})")
    else:
        check(False, f"the greedy answer is too short to pick a stop string from: {full!r}")

    r = client.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content if r.choices[0].logprobs else []
    check(len(lp) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in lp)
          and all((e.model_extra or {}).get("rung") for e in lp),
          f"logprobs: {[(e.token, round(e.logprob, 3)) for e in lp[:4]]}… rung {(lp[0].model_extra or {}).get('rung') if lp else None}")

    sampled = [client.chat.completions.create(model=model, messages=ask, max_tokens=16, temperature=0.9,
                                              seed=seed).choices[0].message.content for seed in (7, 7, 8)]
    check(sampled[0] == sampled[1], f"seed 7 twice gives the same answer: {sampled[0]!r}")
    print(f"  (seed 8: {sampled[2]!r})")

    r = client.chat.completions.create(
        model=model, max_tokens=64, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with keys name, age and colour."}])
    body = r.choices[0].message.content or ""
    try:
        parsed = json.loads(body)
        check(isinstance(parsed, dict), f"json_object: {body!r}")
    except ValueError:
        check(r.choices[0].finish_reason == "length" and body.lstrip().startswith("{"),
              f"json_object (cut by max_tokens): {body!r}")
    try:
        client.chat.completions.create(model=model, messages=ask, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
        check(False, "json_schema is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400, "json_schema -> BadRequestError 400")

    r = client.chat.completions.create(model=model, messages=ask, max_completion_tokens=5, temperature=0,
                                       presence_penalty=0.5, frequency_penalty=0.5)
    check(r.usage.completion_tokens <= 5, f"max_completion_tokens=5 with penalties: {r.usage.completion_tokens} tokens")

    c = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0,
                                  logprobs=2, stop=["\n\n\n"])
    check(bool(c.choices[0].text) and c.choices[0].logprobs is not None
          and len(c.choices[0].logprobs.tokens or []) == c.usage.completion_tokens,
          f"completions: {c.choices[0].text!r}")
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0, stop=["\n\n\n"], stream=True)
        if ch.choices)
    check(streamed == c.choices[0].text, "streamed completion matches the non-streamed one")


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
        max_tokens=args.max_tokens, stream=True, logprobs=True, top_logprobs=2,
    )
    n_tokens = 0
    finish = None
    logprob_rungs: list[tuple[str | None, str | None, int]] = []
    for chunk in stream:
        m = molt_of(chunk)
        if m is not None:
            events.append(m)
        if chunk.choices:
            c = chunk.choices[0]
            if c.delta and c.delta.content:
                text.append(c.delta.content)
            if c.logprobs and c.logprobs.content and m:
                entry = c.logprobs.content[0]
                logprob_rungs.append(((entry.model_extra or {}).get("rung"), m.get("rung"), len(entry.top_logprobs)))
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
    check(len(logprob_rungs) == len(tokens) and all(a == b and k == 2 for a, b, k in logprob_rungs),
          f"{len(logprob_rungs)} logprobs entries with 2 alternatives, each naming its chunk's rung "
          f"({sorted({a for a, _, _ in logprob_rungs if a})})")
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

    fields_checks(client, model, check)

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
