#!/usr/bin/env node
// The official `openai` npm client (a second ecosystem beside scripts/openai_client_check.py)
// against a running `molt-run serve`: a streamed chat with logprobs through a budget cut posted
// mid-stream (every token's logprobs entry names the rung of its chunk, and the rung changes at
// the switch); `stop` streamed and not (the text before the stop string, never part of it);
// `seed`; `response_format: json_object`; `/v1/completions` streamed and not.
//
// Usage (after `npm install openai` in this directory or any parent, or with NODE_PATH set):
//     node scripts/openai_node_check.mjs --base-url http://127.0.0.1:8088/v1
// Exit status 0 when every check passed, 1 otherwise. The budget is left unlimited.

import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
let OpenAI, version;
try {
  OpenAI = require("openai");
  version = require("openai/version").VERSION;
} catch {
  console.error("this check needs the openai package: npm install openai (or set NODE_PATH)");
  process.exit(2);
}
OpenAI = OpenAI.default || OpenAI.OpenAI || OpenAI;

const arg = (name, dflt) => {
  const i = process.argv.indexOf(name);
  return i >= 0 ? process.argv[i + 1] : dflt;
};
const baseURL = arg("--base-url", "http://127.0.0.1:8088/v1");
const maxTokens = Number(arg("--max-tokens", "32"));
const cutAfter = Number(arg("--cut-after", "8"));
const root = baseURL.replace(/\/+$/, "").replace(/\/v1$/, "");
const client = new OpenAI({ baseURL, apiKey: "not-needed", maxRetries: 0, timeout: 600_000 });
const failures = [];
const check = (ok, what) => {
  console.log((ok ? "  ok    " : "  FAIL  ") + what);
  if (!ok) failures.push(what);
};
const http = async (path, body) => {
  const r = await fetch(root + path, body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  return r.json();
};

console.log(`openai (npm) ${version} against ${baseURL}`);
const model = (await client.models.list()).data[0].id;
const status = await http("/v1/molt/status");
const rungs = status.engine.rungs;
// A budget that holds the smallest rung with a full context but not the next larger one.
const lo = rungs.at(-1).full_context_mib, hi = rungs.at(-2).resident_mib;
const cutMib = lo < hi ? (lo + hi) / 2
  : rungs.at(-1).resident_mib + rungs.at(-1).kv_bytes_per_token * status.engine.n_ctx / 4 / 2 ** 20;
await http("/v1/molt/budget", { unlimited: true });

// Streamed, with logprobs, through a budget cut.
const ask = [{ role: "user", content: "Write a Python function that merges two sorted lists." }];
const stream = await client.chat.completions.create({
  model, messages: ask, max_tokens: maxTokens, stream: true, logprobs: true, top_logprobs: 2,
});
let n = 0, cut = null, switched = null;
const pairs = [];
for await (const chunk of stream) {
  const m = chunk.molt;
  if (m?.event === "switch") switched = m;
  if (m?.event !== "token") continue;
  n += 1;
  const entry = chunk.choices[0]?.logprobs?.content?.[0];
  pairs.push([entry?.rung, m.rung, entry?.top_logprobs?.length]);
  if (n === cutAfter) cut = http("/v1/molt/budget", { mib: cutMib });
}
await cut;
check(n > cutAfter, `${n} token chunks`);
check(pairs.every(([a, b, k]) => a === b && k === 2),
  `every logprobs entry names its chunk's rung (${[...new Set(pairs.map((p) => p[0]))].join(" -> ")})`);
check(switched !== null, switched ? `switch ${switched.from} -> ${switched.to} before token ${switched.at_token}, ${switched.cost_ms.toFixed(1)} ms` : "a switch event");
await http("/v1/molt/budget", { unlimited: true });

// Stop, streamed and not.
const base = await client.chat.completions.create({ model, messages: ask, max_tokens: 24, temperature: 0 });
const full = base.choices[0].message.content;
const at = Math.min(8, Math.max(full.length - 2, 0));
const stop = full.slice(at, at + 2);
const want = full.slice(0, full.indexOf(stop));
const r = await client.chat.completions.create({ model, messages: ask, max_tokens: 24, temperature: 0, stop: [stop] });
check(r.choices[0].message.content === want && r.choices[0].finish_reason === "stop",
  `stop=${JSON.stringify(stop)}: ${JSON.stringify(r.choices[0].message.content)}`);
let streamed = "", fin = null;
for await (const c of await client.chat.completions.create({ model, messages: ask, max_tokens: 24, temperature: 0, stop, stream: true })) {
  streamed += c.choices[0]?.delta?.content ?? "";
  fin = c.choices[0]?.finish_reason ?? fin;
}
check(streamed === want && fin === "stop", `streamed stop: ${JSON.stringify(streamed)} (finish ${fin})`);

// Seed.
const sample = async (seed) => (await client.chat.completions.create({
  model, messages: ask, max_tokens: 12, temperature: 0.9, seed,
})).choices[0].message.content;
const [s1, s2] = [await sample(11), await sample(11)];
check(s1 === s2, `seed 11 twice: ${JSON.stringify(s1)}`);

// JSON.
const j = await client.chat.completions.create({
  model, max_tokens: 48, temperature: 0, response_format: { type: "json_object" },
  messages: [{ role: "user", content: "A JSON object describing a dog with keys name and age." }],
});
const body = j.choices[0].message.content;
let parsed = null;
try { parsed = JSON.parse(body); } catch { /* cut by max_tokens */ }
check(parsed !== null ? typeof parsed === "object" : j.choices[0].finish_reason === "length" && body.trimStart().startsWith("{"),
  `json_object: ${JSON.stringify(body)}`);

// Plain completions.
const c = await client.completions.create({ model, prompt: "def add(a, b):", max_tokens: 16, temperature: 0, logprobs: 1 });
let ct = "";
for await (const ch of await client.completions.create({ model, prompt: "def add(a, b):", max_tokens: 16, temperature: 0, stream: true })) {
  ct += ch.choices[0]?.text ?? "";
}
check(c.choices[0].text.length > 0 && ct === c.choices[0].text && c.choices[0].logprobs.tokens.length === c.usage.completion_tokens,
  `completions, streamed and not: ${JSON.stringify(ct)}`);

console.log(failures.length ? `${failures.length} check(s) failed` : "all checks passed");
process.exit(failures.length ? 1 : 0);
