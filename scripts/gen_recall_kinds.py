#!/usr/bin/env python3
"""Generate recall items for kinds of context beyond meeting notes (benches/recall/kinds.jsonl).

Deterministic, stdlib only:

    python3 scripts/gen_recall_kinds.py           # writes benches/recall/kinds.jsonl
    python3 scripts/gen_recall_kinds.py --out X   # writes elsewhere

Every item has the fields of benches/recall/items.jsonl (see gen_recall_items.py) and a
`context_kind`:

* repetitive    the same few boilerplate paragraphs again and again; the fact's sentence once
* code          a Python module; the fact is a constant, a function's name or a default
* log           a service log of repeating lines; the fact is on one line
* conversation  a chat transcript; the fact was given in the first turns, many turns back
* two-place     notes where the answer needs two sentences far apart (a reference and its value)

Lengths 512 and 1024 (Qwen2 tokens, approximated), both switch points for every kind. A
one-sentence answer (switch before token 1) is given 24 tokens. The items are written round
by round (ROUNDS), so a run cut short has measured every kind at both lengths and both
switch points.
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_recall_items import FILLER  # noqa: E402  (digit-free note paragraphs)

SEED = "recall-kinds-v1"
LENGTHS = [512, 1024]
# The switch points and fact positions of a kind's three items at each length.
SLOTS = {
    512: [("first", "start"), ("mid", "middle"), ("first", "end")],
    1024: [("mid", "start"), ("first", "middle"), ("mid", "end")],
}
# Characters per Qwen2 token, roughly, for each kind of text.
CHARS_PER_TOKEN = {"prose": 4.6, "code": 3.4, "log": 3.1}

BOILERPLATE = [
    "Reminder for everyone on the floor: sign in at the front desk when you arrive. Return your visitor badge at the end of the day. Keep the corridor clear of boxes and trolleys. Questions about the building go to the facilities channel.",
    "This section is maintained by the documentation bot. Do not edit it by hand, because manual changes are overwritten at the next sync. Corrections should be raised with the platform group. Thank you for keeping the handbook tidy.",
    "Daily stand-up summary: no blockers were reported today. The team continues to work towards the current sprint goals. Several small changes are still waiting for review. The next planning session is scheduled as usual.",
    "Please remember that the kitchen is cleaned every evening. Label your food with your name and the date. Anything left in the fridge on Friday afternoon is thrown away. Mugs belong in the dishwasher, not in the sink.",
]

REPETITIVE = [
    dict(plant="Note for operators: the staging cache now listens on port 7710 instead of the old one.",
         q="Which port does the staging cache listen on now?",
         ask="state the port the staging cache now listens on", expected=["7710"]),
    dict(plant="The guest wireless passphrase for the third floor is amber-falcon-29.",
         q="What is the guest wireless passphrase for the third floor?",
         ask="write out the guest wireless passphrase for the third floor", expected=["amber-falcon-29"]),
    dict(plant="The spare keys for the server room are kept in locker 418 next to the lifts.",
         q="In which locker are the spare keys for the server room kept?",
         ask="name the locker where the spare keys for the server room are kept", expected=["418"]),
    dict(plant="From this week the nightly export job is owned by Teodora Vance.",
         q="Who owns the nightly export job from this week?",
         ask="name the person who owns the nightly export job from this week", expected=["Vance"]),
    dict(plant="The retired build machine has been renamed quartz-lantern and moved to the archive rack.",
         q="What was the retired build machine renamed to?",
         ask="state the new name of the retired build machine", expected=["quartz-lantern"]),
    dict(plant="The PIN for the incident bridge is 903172 until the end of the quarter.",
         q="What is the PIN for the incident bridge?",
         ask="state the PIN for the incident bridge", expected=["903172"]),
]

CODE = [
    dict(plant=("const", "MAX_UPLOAD_RETRIES", "11"),
         q="What value is MAX_UPLOAD_RETRIES set to in this module?",
         ask="state the value MAX_UPLOAD_RETRIES is set to", expected=["11"]),
    dict(plant=("func", "purge_orphaned_thumbnails", "Delete thumbnail files whose source image no longer exists."),
         q="What is the name of the function that deletes thumbnail files whose source image no longer exists?",
         ask="give the name of the function that deletes thumbnail files whose source image no longer exists",
         expected=["purge_orphaned_thumbnails"]),
    dict(plant=("default", "open_ledger_connection", "timeout_s", "37"),
         q="What is the default value of timeout_s in open_ledger_connection?",
         ask="state the default value of timeout_s in open_ledger_connection", expected=["37"]),
    dict(plant=("const", "ARCHIVE_BUCKET", '"cold-vault-eu2"'),
         q="Which bucket name is ARCHIVE_BUCKET set to?",
         ask="state the bucket name ARCHIVE_BUCKET is set to", expected=["cold-vault-eu2"]),
    dict(plant=("func", "reconcile_invoice_drafts", "Merge draft invoices that share a customer and a billing period."),
         q="What is the name of the function that merges draft invoices sharing a customer and a billing period?",
         ask="give the name of the function that merges draft invoices sharing a customer and a billing period",
         expected=["reconcile_invoice_drafts"]),
    dict(plant=("default", "schedule_report", "max_rows", "2500"),
         q="What is the default value of max_rows in schedule_report?",
         ask="state the default value of max_rows in schedule_report", expected=["2500"]),
]

LOG = [
    dict(plant="ERROR backup: snapshot failed for volume vol-8c2f1e (checksum mismatch)",
         q="For which volume did the backup snapshot fail?",
         ask="name the volume the backup snapshot failed for", expected=["vol-8c2f1e"]),
    dict(plant="WARN  auth: account locked after repeated failures user=okafor.m",
         q="Which user account was locked after repeated failures?",
         ask="name the user account that was locked after repeated failures", expected=["okafor.m"]),
    dict(plant="INFO  deploy: release tag r2026.17.4 promoted to production",
         q="Which release tag was promoted to production?",
         ask="state the release tag that was promoted to production", expected=["r2026.17.4"]),
    dict(plant="ERROR worker: job 48213 killed after exceeding its memory limit",
         q="Which job was killed after exceeding its memory limit?",
         ask="state the number of the job that was killed after exceeding its memory limit", expected=["48213"]),
    dict(plant="WARN  dns: resolver fell back to secondary server 10.44.7.19",
         q="Which secondary server did the DNS resolver fall back to?",
         ask="state the address of the secondary server the DNS resolver fell back to", expected=["10.44.7.19"]),
    dict(plant="INFO  billing: invoice run finished, batch id inv-b7730 exported",
         q="What batch id did the invoice run export?",
         ask="state the batch id the invoice run exported", expected=["inv-b7730"]),
]

CONVERSATION = [
    dict(plant=("User: Before we start, note that my gym locker number is 2231; I keep forgetting it.",
                "Assistant: Noted, your gym locker number is 2231."),
         q="Earlier in this conversation the user gave their gym locker number. What is it?",
         ask="state the gym locker number the user gave earlier in this conversation", expected=["2231"]),
    dict(plant=("User: One thing first: our project's code name is Blue Heron, please use it from now on.",
                "Assistant: Understood, I will call the project Blue Heron."),
         q="What code name did the user give the project at the start of this conversation?",
         ask="state the code name the user gave the project at the start", expected=["Heron"]),
    dict(plant=("User: My flight next month is LX 3318, in case it matters for the plans.",
                "Assistant: Thanks, I will keep flight LX 3318 in mind."),
         q="Which flight did the user say they are taking next month?",
         ask="state the flight number the user said they are taking next month", expected=["3318"]),
    dict(plant=("User: For the record, my sister's name is Ingrid Solberg and she is joining the trip.",
                "Assistant: Great, Ingrid Solberg is joining the trip."),
         q="What is the name of the user's sister who is joining the trip?",
         ask="state the name of the user's sister who is joining the trip", expected=["Solberg"]),
    dict(plant=("User: The wifi at the cabin uses the password pine-otter-64, I wrote it down somewhere.",
                "Assistant: Got it, the cabin wifi password is pine-otter-64."),
         q="What is the wifi password at the cabin the user mentioned?",
         ask="state the wifi password at the cabin the user mentioned", expected=["pine-otter-64"]),
    dict(plant=("User: Our apartment door code is 7146, the neighbours keep asking me for it.",
                "Assistant: Okay, the apartment door code is 7146."),
         q="What is the apartment door code the user mentioned early in the conversation?",
         ask="state the apartment door code the user mentioned early on", expected=["7146"]),
]

CHAT_TURNS = [
    ("User: What is a good way to keep basil fresh for longer?",
     "Assistant: Trim the stems, stand them in a glass of water like flowers, and keep the glass on the counter away from direct sun. Basil dislikes the cold of the fridge."),
    ("User: Can you suggest a quick weeknight dinner with chickpeas?",
     "Assistant: A chickpea curry works well: fry onion, garlic and ginger, add curry paste, tinned tomatoes and chickpeas, simmer for a while and finish with spinach and a squeeze of lemon."),
    ("User: How do I stop my bike chain from squeaking?",
     "Assistant: Clean the chain with a rag and a little degreaser, let it dry, then apply a drop of chain lubricant to each link while turning the pedals backwards, and wipe off the excess."),
    ("User: Is it better to stretch before or after running?",
     "Assistant: A short dynamic warm-up before running is usually best, such as leg swings and easy jogging, while longer static stretches fit better after the run when the muscles are warm."),
    ("User: What should I pack for a rainy weekend in the mountains?",
     "Assistant: Bring a waterproof jacket and trousers, layers you can add or remove, sturdy boots, a spare pair of socks in a dry bag, a warm hat and a small towel."),
    ("User: Any tips for reading more books this year?",
     "Assistant: Keep a book with you, read a few pages at fixed moments like before bed, drop books you do not enjoy, and mix long novels with shorter essays to keep the pace up."),
    ("User: How can I make my home office less noisy?",
     "Assistant: Soft furnishings help most: a rug, curtains and a bookshelf on the shared wall absorb sound, and a door sweep closes the gap under the door."),
    ("User: What is a polite way to decline a meeting?",
     "Assistant: Thank the organiser, say briefly that you cannot attend, and offer an alternative such as reading the notes afterwards or sending your input in writing beforehand."),
    ("User: How often should I water a snake plant?",
     "Assistant: Only when the soil has dried out completely, which is usually every few weeks; in winter even less often. Overwatering is the most common way to harm it."),
    ("User: Could you explain what a sourdough starter is?",
     "Assistant: It is a mixture of flour and water in which wild yeast and bacteria live. Fed regularly, it becomes active enough to make bread rise and gives it a tangy flavour."),
    ("User: What is a sensible way to plan a weekly budget?",
     "Assistant: List your fixed costs first, set aside savings, then divide what is left into a few categories such as food, transport and fun, and review it at the end of each week."),
    ("User: How do I get better at remembering names?",
     "Assistant: Repeat the name when you are introduced, use it once in the conversation, and link it to something about the person. Writing it down afterwards also helps."),
    ("User: Which board games work well for four players?",
     "Assistant: Cooperative games keep everyone involved, and many trading or tile-laying games play well with four. Pick one with short turns so nobody waits too long."),
    ("User: What can I do about a dripping kitchen tap?",
     "Assistant: Usually a worn washer or cartridge is to blame. Turn off the water under the sink, take the handle apart, replace the worn part and reassemble it."),
]

TWO_PLACE = [
    dict(plant=("The quarterly offsite will be held at whichever venue the design team booked for the spring.",
                "Logistics: the design team has booked Larchmont Hall for the spring."),
         q="Where will the quarterly offsite be held?",
         ask="name the place where the quarterly offsite will be held", expected=["Larchmont"]),
    dict(plant=("Project Heron will reuse the budget code of Project Kestrel.",
                "Finance confirmed that Project Kestrel is charged to budget code KX-5519."),
         q="Which budget code will Project Heron use?",
         ask="state the budget code Project Heron will use", expected=["KX-5519"]),
    dict(plant=("The on-call rotation this month is led by the person who wrote the new runbook.",
                "The new runbook was written by Amara Okonkwo over the holidays."),
         q="Who leads the on-call rotation this month?",
         ask="name the person who leads the on-call rotation this month", expected=["Okonkwo"]),
    dict(plant=("The data migration starts on the same floor as the hardware team, in their meeting room.",
                "Facilities moved the hardware team to the ninth floor, room Birch."),
         q="On which floor does the data migration start?",
         ask="state the floor where the data migration starts", expected=["ninth"]),
    dict(plant=("New laptops are ordered from the supplier the security review approved.",
                "The security review approved only one supplier, Northwind Devices."),
         q="From which supplier are new laptops ordered?",
         ask="name the supplier new laptops are ordered from", expected=["Northwind"]),
    dict(plant=("The release freeze begins on the day after the board meeting.",
                "The board meeting was moved to Thursday."),
         q="On which day does the release freeze begin?",
         ask="state the day the release freeze begins", expected=["Friday"]),
]

MID_LEAD = {
    "repetitive": "First write two sentences about what these notes are mostly about, then ",
    "code": "First write two sentences describing what this module does, then ",
    "log": "First write two sentences summarising what this log shows, then ",
    "conversation": "First write two sentences about what this conversation covered, then ",
    "two-place": "First write two sentences about the overall mood of these notes, then ",
}


def fact_kind(expected):
    e = expected[0]
    if e.replace(".", "").isdigit():
        return "number"
    if any(c in e for c in "-_.") or any(c.isdigit() for c in e):
        return "identifier"
    return "name"


def at(position, n):
    """The index among n units where a fact at `position` goes."""
    if position == "start":
        return max(1, n // 12)
    if position == "middle":
        return n // 2
    return max(0, n - 1 - n // 12)


def budget(length, style):
    return int(length * CHARS_PER_TOKEN[style])


def repetitive(rng, fact, length, position):
    blocks = rng.sample(BOILERPLATE, 2)
    units, size, i = [], 0, 0
    while size < budget(length, "prose"):
        units.append(blocks[i % len(blocks)])
        size += len(units[-1]) + 2
        i += 1
    k = at(position, len(units))
    sentences = units[k].split(". ")
    cut = rng.randrange(1, len(sentences))
    units[k] = ". ".join(sentences[:cut]) + ". " + fact["plant"] + " " + ". ".join(sentences[cut:])
    return "\n\n".join(units)


CODE_NOUNS = ["user", "order", "session", "invoice", "report", "image", "token", "account",
              "message", "device", "job", "record", "profile", "payment", "bucket", "event"]
CODE_VERBS = ["load", "save", "validate", "format", "fetch", "delete", "refresh", "render",
              "parse", "export", "sync", "count"]


def code_function(rng, used):
    while True:
        name = f"{rng.choice(CODE_VERBS)}_{rng.choice(CODE_NOUNS)}"
        if name not in used:
            used.add(name)
            break
    noun = name.split("_", 1)[1]
    body = rng.choice([
        f"    if {noun}_id is None:\n        raise ValueError(\"{noun}_id is required\")\n"
        f"    row = db.get(\"{noun}s\", {noun}_id)\n    if row is None:\n        return None\n"
        f"    return {noun.capitalize()}.from_row(row)\n",
        f"    results = []\n    for item in items:\n        if not item:\n            continue\n"
        f"        results.append(item.strip())\n    log.debug(\"{name}: %d items\", len(results))\n"
        f"    return results\n",
        f"    try:\n        payload = client.get(f\"/{noun}s/{{{noun}_id}}\")\n"
        f"    except ClientError as exc:\n        log.warning(\"{name} failed: %s\", exc)\n        return None\n"
        f"    return payload\n",
    ])
    args = f"{noun}_id" if f"{noun}_id" in body else "items"
    doc = f"{name.split('_')[0].capitalize()} the {noun} record."
    return f"def {name}({args}):\n    \"\"\"{doc}\"\"\"\n{body}"


def code(rng, fact, length, position):
    used = set()
    units = []
    header = ("\"\"\"Service helpers for the records API.\"\"\"\n\nimport logging\n\n"
              "from .db import db\nfrom .client import client, ClientError\n\n"
              "log = logging.getLogger(__name__)\n\nPAGE_SIZE = 50\nDEFAULT_REGION = \"eu-west\"\n")
    size = len(header)
    while size < budget(length, "code"):
        units.append(code_function(rng, used))
        size += len(units[-1]) + 2
    p = fact["plant"]
    if p[0] == "const":
        planted = f"{p[1]} = {p[2]}\n"
    elif p[0] == "func":
        planted = (f"def {p[1]}(root):\n    \"\"\"{p[2]}\"\"\"\n    removed = 0\n"
                   f"    for path in root.iterdir():\n        if path.is_file():\n"
                   f"            path.unlink()\n            removed += 1\n    return removed\n")
    else:
        planted = (f"def {p[1]}(name, {p[2]}={p[3]}, retries=3):\n"
                   f"    \"\"\"Open the named resource.\"\"\"\n"
                   f"    return client.open(name, timeout={p[2]}, retries=retries)\n")
    units.insert(at(position, len(units) + 1), planted)
    return header + "\n\n" + "\n\n".join(units)


LOG_LINES = [
    "INFO  scheduler: heartbeat ok queue=0",
    "INFO  http: GET /healthz 200",
    "DEBUG cache: hit ratio above threshold",
    "INFO  scheduler: heartbeat ok queue=0",
    "INFO  worker: picked up routine job from queue",
    "INFO  http: GET /api/items 200",
    "DEBUG pool: connections idle",
    "INFO  worker: routine job finished",
]


def log(rng, fact, length, position):
    lines = []
    t = rng.randrange(3600 * 6, 3600 * 9)
    size = 0
    while size < budget(length, "log"):
        t += rng.randrange(1, 9)
        stamp = f"2026-03-14T{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}Z"
        lines.append((stamp, rng.choice(LOG_LINES)))
        size += len(stamp) + len(lines[-1][1]) + 2
    k = at(position, len(lines))
    lines[k] = (lines[k][0], fact["plant"])
    return "\n".join(f"{s} {m}" for s, m in lines)


def conversation(rng, fact, length, position):
    turns = []
    size = 0
    pool = CHAT_TURNS[:]
    rng.shuffle(pool)
    i = 0
    while size < budget(length, "prose"):
        turns.append("\n".join(pool[i % len(pool)]))
        size += len(turns[-1]) + 2
        i += 1
    # The fact is given in the opening turns whatever the slot says: many turns back.
    k = {"start": 0, "middle": 1, "end": 2}[position]
    turns.insert(k, "\n".join(fact["plant"]))
    return "\n\n".join(turns)


def two_place(rng, fact, length, position):
    pool = FILLER[:]
    rng.shuffle(pool)
    paras, size = [], 0
    while size < budget(length, "prose"):
        paras.append(pool[len(paras) % len(pool)])
        size += len(paras[-1]) + 2
    a, b = fact["plant"]
    # The reference at `position`, its value far from it.
    ka = at(position, len(paras))
    kb = at("start" if position == "end" else "end", len(paras))
    paras[ka] = paras[ka] + " " + a
    paras[kb] = b + " " + paras[kb]
    return "\n\n".join(paras)


KINDS = {
    "repetitive": (REPETITIVE, repetitive),
    "code": (CODE, code),
    "log": (LOG, log),
    "conversation": (CONVERSATION, conversation),
    "two-place": (TWO_PLACE, two_place),
}


# The order items are written in: round by round, every kind in each round, and the first
# rounds cover both lengths and both switch points, so a run cut short has measured every
# kind at every length and switch point.
ROUNDS = [(512, 0), (1024, 0), (1024, 1), (512, 1), (512, 2), (1024, 2)]


def generate():
    items = []
    for length, i in ROUNDS:
        for ck, (facts, build) in KINDS.items():
            switch, position = SLOTS[length][i]
            n = LENGTHS.index(length) * len(SLOTS[length]) + i + 1
            fact = facts[n - 1]
            rng = random.Random(f"{SEED}/{ck}/{n}")
            context = build(rng, fact, length, position)
            if switch == "first":
                question = fact["q"] + " Answer in one full sentence."
            else:
                question = MID_LEAD[ck] + fact["ask"] + "."
            slug = fact["expected"][0].lower().replace(".", "-").replace(" ", "-")
            extra = {"max_tokens": 24} if switch == "first" else {}
            items.append(dict(
                id=f"{ck}-{length}-{position}-{slug}",
                kind=fact_kind(fact["expected"]),
                context_kind=ck,
                length=length,
                position=position,
                switch=switch,
                context=context,
                question=question,
                expected=fact["expected"],
                **extra,
            ))
    for it in items:
        low = it["context"].lower()
        assert all(e.lower() in low or it["context_kind"] == "two-place" for e in it["expected"]), it["id"]
    return items


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "benches", "recall", "kinds.jsonl"))
    args = ap.parse_args()
    items = generate()
    with open(args.out, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    print(f"wrote {len(items)} items to {args.out}")


if __name__ == "__main__":
    main()
