#!/usr/bin/env python3
"""Append the recall items' twins to benches/recall/items.jsonl.

A twin is an item with the same context and fact, asked at the other switch point: an item
asked directly (switch "first") gets a twin whose question asks for a preamble first
(switch "mid"), and the other way round. Each cell of length x switch point at ~1,800 tokens
then holds every fact of that length once: 24 items instead of 12 at ~1,800 tokens, 12 instead
of 6 at ~256-1,024, so one item moves a cell's recall by half as much. The ~1,800-token questions
below are hand-written (those items were written beside the generator, so their facts are not in
its table); the shorter items' twins take the direct question and the request clause their fact
has in the generator's table.

Deterministic and idempotent, stdlib only:

    python3 scripts/recall_twins.py           # appends the twins not yet in the file
    python3 scripts/recall_twins.py --check   # says what it would append, writes nothing
"""

import argparse
import json
import os
import sys

# The generator's mid-question preambles and first-question suffix, in its order.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_recall_items import FACTS, FIRST_SUFFIX, PREAMBLES  # noqa: E402

# Items asked directly: the request as a clause, for the twin asked after a preamble.
ASK = {
    "str-1800-start-guild-room": "name the room where the architecture guild now meets",
    "two-1800-end-mentor-badge": "give the building badge number of the mentor assigned to this summer's intern cohort",
    "ident-1800-start-cli-drain": "name the command-line flag that should be passed to the deploy tool when rotating nodes out",
    "name-1800-end-deletion-lead": "give the full name of the engineer leading the new deletion workflow project",
    "ident-1800-middle-queue-deadletter": "name the queue to which failed webhooks are now moved for manual replay",
    "two-1800-middle-codename-flag": "name the exact feature flag the billing rewrite will launch behind",
    "num-1800-start-failover-lag": "state by how many milliseconds at most the read replicas fell behind the primary during the failover rehearsal",
    "num-1800-end-clickstream-days": "say after how many days raw clickstream events will now be deleted",
    "ident-1800-middle-job-orphan-sweep": "give the name under which the nightly job that removes orphaned uploads is registered in the scheduler",
    "name-1800-start-move-coordinator": "give the full name of the person coordinating the office move",
    "str-1800-end-migration-error": "quote the exact message the tenant migration script prints when it reaches a row it cannot convert",
    "two-1800-middle-firewall-exception": "say who approved the firewall exception for the logistics partner's traffic and under which ticket it is recorded",
}

# Items asked after a preamble: the direct question, for the twin asked before token 1.
ASKED = {
    "num-1800-start-checkout-rps": "At how many requests per second did the checkout service peak during the load test?",
    "ident-1800-middle-table-consent": "What is the exact name of the database table that the consent report reads from?",
    "name-1800-start-translation-coordinator": "What is the full name of the person who will coordinate translation reviews for the new markets?",
    "num-1800-end-venue-seats": "How many people can the shortlisted hall for the department gathering seat?",
    "str-1800-end-sync-error-msg": "What exact message do users see in the status bar when they hit the sync bug?",
    "two-1800-middle-archive-host-path": "What is the host of the cold archive, and under which path are the quarterly snapshots kept?",
    "num-1800-middle-conference-cap": "What is the most that each attendee may spend on flights and hotel combined for the autumn conference trip?",
    "ident-1800-start-metrics-host": "What is the hostname of the machine that runs the new long-term metrics store?",
    "ident-1800-end-audit-namespace": "Into which Kubernetes namespace will the audit scanners be deployed?",
    "name-1800-end-contract-negotiator": "What is the full name of the person leading negotiations for the renewed cloud hosting contract?",
    "str-1800-middle-candidate-lounge": "What is the name of the lounge where candidates wait before their on-site interviews?",
    "two-1800-start-staging-host-port": "What are the host and the port of the staging copy of the orders database?",
}

SUFFIX = {"first": "-asked-mid", "mid": "-asked-first"}

# The generator's facts by the slug that ends an item's id ("num-256-middle-gateway-port").
BY_SLUG = {f["slug"]: f for facts in FACTS.values() for f in facts}


def generated_fact(item):
    """The generator's fact an item of ~256-1,024 tokens was built from."""
    prefix = f"-{item['length']}-{item['position']}-"
    slug = item["id"].split(prefix, 1)[1]
    fact = BY_SLUG[slug]
    assert fact["expected"] == item["expected"], (item["id"], "fact and item disagree")
    return fact


def twin(item, n_mid):
    """The item asked at the other switch point; `n_mid` picks the preamble."""
    fact = generated_fact(item) if item["length"] != 1800 else None
    if item["switch"] == "first":
        ask = fact["ask"] if fact else ASK[item["id"]]
        question = PREAMBLES[n_mid % len(PREAMBLES)].format(ask=ask)
        switch = "mid"
    else:
        question = (fact["q"] if fact else ASKED[item["id"]]) + FIRST_SUFFIX
        switch = "first"
    for e in item["expected"]:
        assert e.lower() not in question.lower(), (item["id"], "question leaks", e)
    out = dict(item)
    out.update(id=item["id"] + SUFFIX[item["switch"]], switch=switch, question=question)
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, "..", "benches", "recall", "items.jsonl"))
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", default=path)
    ap.add_argument("--check", action="store_true", help="say what would be appended only")
    args = ap.parse_args()
    with open(args.items, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    ids = {i["id"] for i in items}
    originals = [i for i in items if not i["id"].endswith(tuple(SUFFIX.values()))]
    long = {i["id"] for i in originals if i["length"] == 1800}
    missing = sorted(long - set(ASK) - set(ASKED))
    if missing:
        sys.exit(f"no twin question written for {', '.join(missing)}")
    # The preambles rotate within each length, so adding a length's twins leaves another's as they were.
    new, n_mid = [], {}
    for item in originals:
        t = twin(item, n_mid.get(item["length"], 0))
        n_mid[item["length"]] = n_mid.get(item["length"], 0) + (t["switch"] == "mid")
        if t["id"] not in ids:
            new.append(t)
    for t in new:
        print(f"{t['id']}: {t['switch']}: {t['question']}")
    if args.check or not new:
        print(f"{len(new)} twins to append" + (" (nothing written)" if args.check else ""))
        return
    with open(args.items, "a", encoding="utf-8") as f:
        for t in new:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    print(f"appended {len(new)} twins to {args.items}")


if __name__ == "__main__":
    main()
