#!/usr/bin/env python3
"""Generate the "context recall" benchmark items (benches/recall/items.jsonl).

Deterministic, stdlib only.  Run from anywhere:

    python3 scripts/gen_recall_items.py            # writes benches/recall/items.jsonl
    python3 scripts/gen_recall_items.py --out X    # writes elsewhere
    python3 scripts/gen_recall_items.py --check    # build + assert, write nothing

Each item is a JSON object:
    id, kind, length, position, switch, context, question, expected

* kind      number | identifier | name | string | two-part
* length    target context length in Qwen2 tokens (256, 512, 1024, 1800),
            approximated as words * 1.33 (see TOKENS_PER_WORD)
* position  where the planted fact sits: start (first ~10% of the context),
            middle, end (last ~10%).  For two-part items `position` is where
            part A sits (the part carrying the first expected value); part B
            is planted far away (start <-> end, middle -> start or end).
* switch    first: the question asks for the fact directly ("Answer in one
            full sentence.");  mid: the question asks for a preamble of at
            least two sentences first and only then for the fact.
* expected  strings that must ALL appear (case-insensitive) in a correct answer.

Filler is drawn from FILLER (hand-written, digit-free, name-free paragraphs)
with a random.Random seeded from the item id, skipping paragraphs that touch
the fact's topic (each fact lists `avoid` regexes).
"""

import argparse
import collections
import json
import os
import random
import re
import sys

SEED = "recall-v1"
TOKENS_PER_WORD = 1.33
LENGTHS = [256, 512, 1024, 1800]
WORD_TOL = 0.07        # aim: words within +-7% of target
WORD_TOL_HARD = 0.12   # assert: within +-12% (brief allows +-15% tokens)
TAKEN = ["port 7319", "zq_parse_ledger_v2", "MOLTEX_TRACE_DEEP",
         "Tomasz Okonkwo-Reyes", "tangerine-otter-58", "Pistachio", "Ilse",
         "8080", "John Smith"]

# --------------------------------------------------------------------------
# Filler paragraphs.  Rules: 40-110 words, no digits, no personal or product
# names; generic roles only ("the platform lead").
# --------------------------------------------------------------------------
FILLER = [
    "Platform standup. The platform lead opened by saying the queue rebalancing work is finally unblocked now that the storage team has merged its retry changes. Two engineers are pairing on the remaining flaky integration tests, which tend to fail only when the shared runners are busy. Someone asked whether those tests should be quarantined for a while; the consensus was no, because quarantined tests have a habit of staying quarantined forever. The lead will check in again at the end of the week.",
    "Quarterly budget review. Finance walked through spending against plan for the infrastructure group. Cloud costs are slightly over forecast, mostly because the analytics cluster was left at peak size after the seasonal surge ended. The group agreed to send a weekly cost report to every team lead rather than only to management, on the theory that people who can see the bill are more careful with it. Training spend is under plan, and managers were encouraged to actually use it before the year closes.",
    "Incident retrospective. The outage began when a configuration change to the rate limiter was rolled out to every region at once instead of one region at a time. Alerts fired within minutes, but the on-call engineer spent a long stretch looking at the wrong dashboard because the alert text pointed at an old service name. Action items: fix the alert text, make staged rollout the default for limiter changes, and add a short checklist to the deploy tool. Nobody was blamed; the room agreed the process made the mistake easy.",
    "Design review for the notification service. The proposal replaces the current polling loop with a push model built on the existing message bus. Reviewers liked the reduced load but worried about ordering guarantees when a subscriber reconnects after a long gap. The author agreed to write up exactly what happens to messages that arrive while a client is offline, and to add a section on how the change would be rolled back if the push path misbehaves in production. A second review will follow that write-up.",
    "Hiring sync. The recruiting partner reported a healthy pipeline for the backend roles but very few applicants for the site reliability opening. The panel discussed whether the job description is scaring people off; it lists an intimidating number of tools, most of which a new hire could learn on the job. The hiring manager will trim it to the essentials and emphasise mentoring. Interviewers were also reminded to submit feedback within a day, since slow feedback has already cost us strong candidates this season.",
    "Office logistics. Facilities let everyone know that the upstairs kitchen will be closed for renovation for most of next month, so please use the kitchen near the lobby in the meantime. The coffee machine by the lifts is being replaced with a model that, we are promised, does not leak. Please stop storing bicycles in the stairwell; the fire inspector was not amused. Desk booking is moving to the new internal tool, and the old spreadsheet will be archived at the end of the month.",
    "Release planning. The release manager proposed freezing features a few days earlier than usual to give the quality team more time with the candidate build. Product was reluctant because two customer-facing improvements are close to done, but agreed once it was clear they could ship in a follow-up patch. The group also decided that release notes should be drafted alongside the work rather than scraped together on the last afternoon. Translation of the notes will be requested as soon as the freeze begins.",
    "Customer call notes. The customer's operations team joined to talk through the slow report exports they have been seeing. They run exports at the start of every business day, which lines up badly with our own maintenance window overlapping their morning. Our solutions engineer suggested staggering the exports, and we committed to investigating whether maintenance can shift later. The customer was friendly but clear that this is the main thing souring their experience, so the account team wants a written update before the end of next week.",
    "Security review. The security team presented findings from the internal audit of service accounts. A handful of accounts still have broad write permissions that nobody can justify, and several have not been used in months. Owners have been asked to either document why each account needs its access or let it be disabled. The team also wants every new service account to expire by default unless someone renews it, which drew some grumbling but no real objection.",
    "Data team standup. The nightly pipeline ran clean for the first time in a while after the schema drift fix landed. The analysts asked for a heads up before any column is renamed, because their dashboards break silently and they only find out when an executive asks why a chart is empty. The data lead agreed to add a change notice step to the migration template. There was also a short discussion about retiring the legacy warehouse tables, which everyone wants but nobody has time to do.",
    "Mobile sync. The mobile team shipped the redesigned settings screen to a small slice of users, and the early feedback is mostly positive apart from confusion about where notification preferences went. Crash rates are flat. The team would rather add an onboarding hint than move the preferences back. They also flagged that app store review times have been unpredictable lately, so any release with a hard deadline should be submitted earlier than usual.",
    "Frontend performance review. Page load times on the dashboard have crept up over the last few releases, mostly because a charting library gets loaded on every page even when no chart is shown. The frontend lead proposed loading it lazily and adding a size limit that fails the build when the main bundle grows beyond an agreed threshold. Designers asked that the loading states stay consistent, so a shared skeleton component will be built first.",
    "Support escalations. The support lead summarised the week: most tickets were password resets and billing questions, but a cluster of reports about missing email confirmations needs engineering attention. It looks like one mail provider started treating our messages as spam. The messaging team will review the sender configuration, and support will publish a short help article in the meantime. The support lead also asked for a clearer path to escalate urgent issues outside business hours.",
    "Architecture guild. This session was about how services should share configuration. Some teams copy configuration files between repositories, others read from the central store, and a few simply hard-code values. The guild did not try to settle everything but agreed on a principle: secrets never live in repositories, and anything that differs between environments should come from the central store. A short written guide will follow, with examples from teams that already do this well.",
    "Onboarding feedback. Recent hires said the first week is well organised but the second week falls off a cliff, with no clear starter project and too many documents of uncertain age. The engineering managers agreed to keep a small list of good first tasks in every team and to mark outdated wiki pages instead of leaving them around to mislead people. A buddy system will be tried for the next group of hires, with buddies getting a little protected time in their calendars.",
    "Capacity planning. The infrastructure team projected storage growth for the next two quarters, and the picture is uncomfortable. Most of the growth comes from debug logs that are kept far longer than anyone reads them. The proposal is to keep detailed logs for a short window and then keep only sampled or aggregated versions. A few teams objected that they occasionally need old detailed logs for audits, so the plan now includes an archive tier that is slow to query but cheap to keep.",
    "Accessibility review. An outside consultant's report on the web app came back with a list of issues, most of them modest: missing labels on icon buttons, low contrast in the secondary palette, and a modal that traps keyboard focus. The design system team will fix the shared components first, since that clears most problems everywhere at once. Product agreed that accessibility fixes count as regular roadmap work and should not be squeezed into spare time.",
    "Dependency check-in. The payments team is waiting on the identity team for the new session token format, and the identity team is waiting on security sign-off. Everybody agreed this chain is too long. The security reviewer will join the identity team's next design session directly so questions can be answered on the spot. In the meantime, payments will build against a stub so that integration work does not sit idle.",
    "Documentation day. Several teams spent the afternoon cleaning up their runbooks. The most common problem was runbooks that describe a system as it used to be, with commands that no longer work. A simple rule came out of it: any change that alters how a service is operated must update the runbook in the same pull request. Reviewers are expected to check for this, and the pull request template now has a checkbox to make it harder to forget.",
    "Machine learning sync. The recommendations model was retrained on the cleaned dataset, and offline metrics improved modestly. The team is cautious, because the last offline improvement turned into a slight online regression. An experiment will run on a small share of traffic, and the team will watch engagement and complaint rates rather than a single headline number. There was also a request for more predictable access to the shared training hardware, which is often booked solid.",
    "Vendor evaluation. Procurement and the observability group compared three monitoring providers. All of them cover the basics; the differences are in pricing models and in how painful it would be to leave later. The group leaned towards the option with open data export, even though it is slightly more expensive, because lock-in cost us dearly last time. Legal will review the contract terms before anything is signed.",
    "Team health check. The quarterly survey showed that most people feel good about their teams but stretched by interruptions. Meetings were the most common complaint, followed by unclear priorities. Managers agreed to try a meeting-free afternoon each week and to publish a short, ranked list of priorities for every team. A follow-up survey at the end of the quarter will show whether anything actually changed.",
    "Testing strategy discussion. The quality lead argued that the end-to-end suite has grown so slow that people avoid running it locally, which defeats the purpose. The proposal is to move most of those checks down into faster service-level tests and keep only a thin set of critical user journeys end to end. Some engineers worried about losing coverage, so the plan is to measure what each end-to-end test actually catches before deleting anything.",
    "Database migration status. The move of the orders tables to the new cluster is about two thirds done. Reads are already served from the new cluster in most regions; writes still go to the old one until replication lag is consistently low. The database lead wants to run the cutover during the quietest part of the week and has asked every team with a scheduled batch job to confirm it can pause for an hour. A rehearsal will happen in staging first.",
    "Roadmap review. Product presented the themes for the next half: better reporting, fewer setup steps for new accounts, and a cleaner permissions model. Engineering leads pushed back on the permissions work being scheduled last, since it touches nearly everything and will only get harder. After some discussion it moved up, with reporting slightly delayed. Product will publish the revised roadmap to the whole company once the leads have had a final look.",
    "Internal tools. The developer experience team demoed the new command line helper for creating services from templates. It sets up the repository, the build pipeline, dashboards and alert stubs in one step. Early users liked it but asked for a way to update existing services when the templates change, since otherwise every service slowly drifts. The team will look at that next and is collecting feedback in a shared channel.",
    "Minor incident review. A scheduled job that cleans up expired sessions ran twice because two instances of the scheduler were briefly active during a deploy. No data was lost, but some users were logged out unexpectedly. The fix is to take a lock before the job runs. The reviewer noted that several other jobs share the same weakness, so the owning teams will be asked to audit them before the next release.",
    "Compliance check-in. The compliance officer reminded teams that the annual data retention review is due. Each team must list what personal data it stores, why, and for how long. Last year several teams answered late and in a hurry, which caused a scramble. This year the list will be pre-filled from the data catalogue, so teams only need to correct it. Questions should go to the privacy channel rather than to individual lawyers.",
    "Sales engineering sync. The sales engineers reported that prospects keep asking for single sign-on during trials, which is currently only enabled on paid plans. Several deals have stalled on this. Product is open to enabling it in trials with a time limit, provided support is not swamped with setup requests. Sales engineering will draft a self-service setup guide to reduce that risk and will share it with support before it goes out.",
    "On-call review. The past rotation was noisy, with most alerts coming from a disk usage check that fires well before anything is in danger. The team agreed to raise the threshold and to alert on the rate of growth rather than the absolute level. They also discussed handover: the outgoing engineer will now write a short note about anything still simmering, instead of relying on memory and the chat history.",
    "Design system update. The design system team released a new set of form components with built-in validation messages. Adoption is voluntary for now, but the old components will stop receiving fixes after next quarter. Several product teams asked for a migration guide with before-and-after examples, and the team agreed to record a short walkthrough as well. Requests for missing variants should be filed in the design system tracker rather than sent privately.",
    "Finance tooling. The finance systems team wants to replace the manual month-end reconciliation, which currently involves exporting several reports and comparing them by hand. Engineering agreed to help build an automated comparison that flags mismatches for a human to review. Nobody wants the tool to make corrections on its own. The first version will cover only the largest accounts, and the rest will follow once the flags prove trustworthy.",
    "Sprint retrospective. What went well: the team finished the search improvements on time, and the new pairing rotation helped spread knowledge around. What did not go well: two stories turned out much larger than estimated, and the team kept discovering hidden work in the legacy import code. The team agreed to do a short spike before estimating anything that touches that code, and to split stories more aggressively from now on.",
    "Offsite planning. The planning committee is looking at venues within driving distance so that nobody has to fly. The agenda will be lighter than last time, with more unstructured time, since people said the best conversations happened over lunch. Dietary requirements and accessibility needs should be sent to the committee early. A short survey on preferred activities will go out soon, and the committee promises it will be brief.",
    "Open source review. The team maintaining our public client library reported a steady stream of outside contributions, mostly documentation fixes and small bug reports. Response times to issues have slipped, which risks discouraging contributors. The proposal is to rotate triage duty weekly among the maintainers and to label beginner-friendly issues clearly. Legal confirmed that the contributor agreement process does not need to change.",
    "Search team sync. Relevance complaints dropped after the synonym list was updated, but latency on long queries is still too high. The team suspects the spelling correction step, which runs on every query even when the query is spelled correctly. They will try skipping it whenever the original query already returns enough results. A small user study is planned to check whether people notice any difference.",
    "Network team update. The network engineers finished replacing the ageing switches in the main office, with only one brief interruption that most people did not notice. Next they want to simplify the firewall rules, many of which were added for projects that ended long ago. Teams will receive a list of rules attributed to them and are asked to confirm which are still needed. Unclaimed rules will be disabled after a notice period.",
    "Cost allocation. Finance wants each team to own the cloud resources it creates, with costs shown per team. The blocker is tagging: many older resources carry no owner tag at all. The infrastructure group will run a sweep to tag whatever it can infer from deployment history, and teams will be asked to claim the rest. Resources still untagged after the deadline will be flagged for deletion review.",
    "Writing culture discussion. Several leads feel that too many decisions are made in meetings and never written down, so newcomers cannot tell why things are the way they are. The group agreed to try short decision records: a page describing the problem, the options considered and the choice made. They should be quick to write, not polished essays. The first few will be reviewed together to calibrate the level of detail.",
    "Customer research readout. The research team interviewed a range of small business users about how they set up their accounts. A recurring theme was that the setup wizard asks for information people do not have on hand, so they abandon it and forget to come back. Suggestions included letting users skip steps and sending a gentle reminder later. Product will prioritise the skip option because it is cheap to build.",
    "Build system update. The build team rolled out remote caching for the main repository, and typical build times on laptops have dropped noticeably. Some engineers still see slow builds because their local setup bypasses the cache, so a short troubleshooting page has been published. The team is also investigating occasional cache poisoning, where a bad artefact gets shared, which is rare but very confusing when it happens.",
    "Resilience exercise. The reliability team ran a planned failure test, deliberately shutting down one availability zone in staging. Most services recovered on their own, but the job scheduler and one internal dashboard did not. Both had hidden assumptions about where their databases lived. Owners have fixes in progress, and the exercise will be repeated after that work is done, this time with less warning.",
    "Performance cycle planning. People operations outlined the timeline for the upcoming review cycle. Self-assessments come first, then peer feedback, then manager write-ups and calibration. Managers asked for the peer feedback form to be shorter, because long forms produce vague answers, and the form will be trimmed accordingly. Everyone was reminded that feedback should describe specific work rather than personality.",
    "API deprecation plan. The platform team wants to retire the oldest version of the public interface. Usage has fallen, but a few large customers still depend on it. The plan is to contact those customers directly, offer migration help, and publish a clear timeline, with warnings in responses well before anything is switched off. Nobody wants a surprise shutdown, so the final date will only be set once the remaining customers have confirmed their plans.",
    "Localisation sync. The localisation team reported that strings keep being added to the product without context, which leads to awkward translations. They asked developers to include a short note with every new string explaining where it appears, and a linting rule will flag strings without notes. Translators also want screenshots for the more ambiguous screens, which the design team agreed to provide.",
    "Analytics governance. There are now several competing definitions of an active user across dashboards, and leadership has noticed. The analytics team proposed a single official definition, with any alternatives clearly labelled. Some product teams prefer their own definitions because they flatter their features, which was acknowledged with some laughter. The official measure will be published with documentation explaining exactly how it is calculated.",
    "Secrets rotation. Security wants all long-lived credentials rotated on a regular schedule, with automation wherever possible. Several services still read credentials at startup and never reload them, so rotation means a restart. The platform team will provide a small library that reloads credentials in the background. Until teams adopt it, rotations will be coordinated with the owners to avoid surprise outages.",
    "Hackathon wrap-up. Teams presented their projects to a packed room. Highlights included a tool that explains failed builds in plain language, a prototype for voice notes in the support console, and a surprisingly popular plugin that tidies up meeting invites. Leadership will pick a couple of projects to fund properly. Participants asked that hackathon work be allowed to continue for a short while afterwards so that promising ideas are not dropped.",
    "Privacy requests. The volume of user data deletion requests has grown, and the current process involves a support agent filing tickets with several teams by hand. The privacy engineer proposed a single workflow that fans the request out automatically and tracks completion. Teams will need to expose a deletion hook for their data stores. The goal is to have every request fully handled well inside the legal deadline.",
    "IT update. Laptop refreshes for people with the oldest machines will start soon, and those eligible will receive a message with the options. The help desk asked that people back up local files before swapping devices, because a few people lost work during the last refresh. Monitors and docking stations can be requested through the usual form, and loaners are available for anyone whose machine fails in the meantime.",
    "Partner integration review. The integrations team walked through the status of the accounting software connector. Sync works for invoices and customers, but payments are trickier because the partner's system allows partial refunds in ways ours does not model. The team proposed starting with a read-only payments view and adding write support later. The partner's technical lead agreed this is a reasonable first step.",
    "Reliability objectives. The reliability council reviewed service level objectives for the customer-facing services. Two services burned through their error allowance early in the quarter, mostly from a single bad deploy each. The rule is that when a service exhausts its allowance, the owning team pauses feature work and focuses on stability until it recovers. Both teams accepted this, though one asked the platform group for help to speed things up.",
    "Lunch and learn. This week's session covered how the query planner chooses indexes, presented by someone from the database team. Attendance was good and the questions were sharp, especially about why a query that looks simple can end up scanning an entire table. The recording is in the shared drive. The next session will cover practical debugging with distributed traces, and volunteers for later sessions are welcome.",
    "Support tooling. Agents asked for a faster way to see a customer's recent errors without asking engineering. The tooling team will add a panel to the support console showing recent failed requests, with sensitive fields masked. Privacy reviewed the design and asked for every access to be logged. A pilot with a few senior agents will come before the wider rollout, and their feedback will shape the final layout.",
    "Deployment pipeline changes. The delivery team is adding automatic rollback when error rates rise sharply after a deploy. Engineers asked how it would tell a deploy-caused spike apart from unrelated traffic surges. The answer is that it compares the new version against instances still running the old one, rather than looking at overall error rates. The feature will first run in a watch-only mode that reports what it would have done.",
    "Team changes. The growth group is splitting into two smaller teams, one focused on sign-up and the other on retention, because the single team had too many stakeholders pulling in different directions. Ownership of shared components will be decided over the next couple of weeks, and until then the current owners keep them. People were encouraged to raise concerns with their managers rather than in hallway conversations.",
    "Billing team sync. The billing team finished moving invoice generation to the new job system. Invoices now go out in smaller batches spread across the night rather than in one large burst, which has eased the load on the database. A few customers on unusual billing schedules received duplicate reminders during the transition, and apologies have gone out. The next project is cleaning up the tax calculation code, which has accumulated many special cases.",
    "Intern programme planning. The early careers team is preparing for this summer's interns. Each intern will have a manager and a separate mentor, and projects must be scoped so that something real can ship by the end. Teams proposing projects were asked to avoid anything that depends on unfinished platform work. A kickoff week with shared sessions on tooling and culture is being organised.",
    "Observability review. Traces now cover most services, but the sampling rate is so low that rare errors are often missing. The observability team proposed keeping every trace that contains an error and sampling the rest, which will raise storage costs a little. Teams also asked for dashboards that link directly to example traces, so they can jump from a spike on a graph to an actual request.",
    "Account review. Customer success presented the health of the largest accounts. Most are stable, one is expanding, and one is at risk because their champion left the company and the new contact is unfamiliar with the product. The account team will offer a fresh onboarding session and a review of how the product fits their current workflows. Engineering was asked to prioritise two small fixes that this customer has been waiting on.",
    "Runtime upgrades. The platform group reminded teams that the language runtime used by most services reaches end of support later this year. Upgrading is mostly mechanical, but a few libraries need replacements. A shared tracking page lists every service and its status. Teams that finish early are asked to write down any surprises so that others can avoid them, and the group will hold open office hours for anyone who gets stuck.",
    "Process note. The engineering managers agreed that recurring meetings without a clear owner or agenda will be cancelled at the end of the month unless someone claims them. Meeting notes should be posted in the team channel within a day, with decisions highlighted at the top so that people who skip the meeting can catch up in a minute. Nobody expects this to fix everything, but it should cut some noise.",
    "Continuous integration health. The share of pipeline runs that fail for reasons unrelated to the code has crept up again. The main culprits are network hiccups when downloading dependencies and a shared test database that sometimes runs out of connections. The build team will add a local mirror for dependencies and give each pipeline its own short-lived database. Until then engineers can rerun failed jobs, but each rerun should be noted in the tracker so the trend stays visible.",
    "Feedback board triage. Product reviewed the most upvoted requests from the public feedback board. The top request is dark mode, followed by bulk editing and better export options. Bulk editing fits the current roadmap and will be scheduled. Dark mode is popular but touches every screen, so the design system team will estimate it before any promise is made. Replies will be posted on the board so users know they were heard.",
    "Hardware lab. The lab team reorganised the test racks so that devices used by the embedded group are no longer mixed in with the general pool. A sign-out sheet now tracks who is using which device and for how long. People are asked to return devices to their slots and to report anything damaged rather than quietly putting it back, since a broken device left on the shelf wastes the next person's afternoon.",
    "Contract renewals. Procurement listed the software contracts that come up for renewal this quarter. A few tools overlap, with different teams paying for similar products. The group will consolidate where it makes sense, but only after asking the heaviest users what they would lose. Renewal requests must be raised well before the notice deadline, because several of these contracts renew automatically and are hard to exit once they do.",
    "Developer survey. The developer experience team shared results from its twice-yearly survey. Slow code review was the biggest frustration, ahead of flaky tests and confusing internal documentation. Teams with a habit of reviewing within the same day reported noticeably higher satisfaction. The team will publish lightweight review guidelines and a dashboard showing how long reviews wait, with the explicit promise that it will not be used to rank individuals.",
    "Email campaign review. Marketing and the lifecycle team looked at the results of the latest re-engagement emails. Open rates were fine, but very few people clicked through, which suggests the message did not match what dormant users actually care about. The next campaign will test shorter emails that point to a single new feature. Engineering asked for more notice before large sends, since the last one caused a surprising spike in sign-in traffic.",
    "Storage team sync. The storage engineers finished the compaction improvements, and disk usage on the busiest clusters has levelled off. Background repair is still slower than anyone would like, so the next task is to parallelise it without starving foreground traffic. The team also wants clearer guidance for other teams on choosing between the object store and the block volumes, because the wrong choice keeps showing up in design documents.",
]

# --------------------------------------------------------------------------
# Facts.  `plant` is the sentence(s) inserted into the context.  For
# two-part facts `plant` is [part_A, part_B]; part A holds expected[0].
# `q` is the direct question; `ask` is the same request phrased as a clause
# for "mid" questions ("... then <ask>.").  `avoid`: regexes; any filler
# paragraph matching one is not used for this fact.
# --------------------------------------------------------------------------
FACTS = {
    "number": [
        dict(slug="gateway-port",
             plant="Networking follow-up: after some back and forth, the ingestion team settled on port 6143 for the new metrics gateway, because the usual choice collides with the tracing sidecar.",
             q="Which port number did the ingestion team settle on for the new metrics gateway?",
             ask="state the exact port number the ingestion team settled on for the new metrics gateway",
             expected=["6143"], avoid=[r"\bports?\b", r"gateway"]),
        dict(slug="rc-build",
             plant="Quality sign-off: the quality team approved release candidate build 20417, and that is the exact build that will be promoted on release day.",
             q="Which release candidate build number did the quality team approve?",
             ask="give the number of the release candidate build that the quality team approved",
             expected=["20417"], avoid=[r"\bbuild", r"candidate"]),
        dict(slug="tickets-closed",
             plant="Support blitz result: by the end of the blitz the support team had closed 947 tickets from the old backlog, which is more than anyone had predicted.",
             q="How many tickets from the old backlog did the support team close during the blitz?",
             ask="say exactly how many tickets from the old backlog the support team closed during the blitz",
             expected=["947"], avoid=[r"ticket", r"backlog"]),
        dict(slug="lab-budget",
             plant="Finance update: the approved hardware budget for the lab expansion is 7386 euros, and anything above that will need a fresh request.",
             q="What hardware budget, in euros, did finance approve for the lab expansion?",
             ask="state the exact hardware budget in euros that finance approved for the lab expansion",
             expected=["7386"], avoid=[r"budget", r"\blab\b"]),
        dict(slug="cage-keypad",
             plant="Facilities note: the keypad code for the storage cage next to the loading dock has been changed to 5820, so please do not write it on the door again.",
             q="What is the new keypad code for the storage cage next to the loading dock?",
             ask="give the new keypad code for the storage cage next to the loading dock",
             expected=["5820"], avoid=[r"keypad", r"\bcage", r"facilities"]),
        dict(slug="audit-log-days",
             plant="Compliance decision: audit logs will be retained for 413 days, a figure chosen to cover the longest customer contract term plus a margin.",
             q="For how many days will audit logs be retained under the compliance decision?",
             ask="state for how many days audit logs will be retained under the compliance decision",
             expected=["413"], avoid=[r"retention", r"retain", r"compliance"]),
        dict(slug="card-timeout",
             plant="Payments change: after the provider's latency spikes, the payments team raised the connection timeout on the card gateway client to 3170 milliseconds.",
             q="What connection timeout, in milliseconds, did the payments team set on the card gateway client?",
             ask="give the connection timeout in milliseconds that the payments team set on the card gateway client",
             expected=["3170"], avoid=[r"timeout", r"gateway", r"payments"]),
        dict(slug="quote-ref",
             plant="Procurement reminder: the quote reference for the monitoring contract is 77031, and it must be included in every email sent to the provider.",
             q="What is the quote reference number for the monitoring contract?",
             ask="state the quote reference number for the monitoring contract",
             expected=["77031"], avoid=[r"procurement", r"\bquote", r"monitoring"]),
        dict(slug="checkout-rps",
             plant="Load test summary: the checkout service peaked at 1879 requests per second before latency started to climb, so the autoscaling trigger will be set below that.",
             q="At how many requests per second did the checkout service peak during the load test?",
             ask="say at how many requests per second the checkout service peaked during the load test",
             expected=["1879"], avoid=[r"load test", r"per second", r"checkout"]),
        dict(slug="venue-seats",
             plant="Venue update: the hall the committee shortlisted for the department gathering can seat 268 people, which comfortably fits everyone including partners.",
             q="How many people can the shortlisted hall for the department gathering seat?",
             ask="state how many people the shortlisted hall for the department gathering can seat",
             expected=["268"], avoid=[r"venue", r"offsite", r"\bseat"]),
        dict(slug="decoder-error",
             plant="Mobile triage: the crash that kept coming back turned out to be error code 4932 from the image decoder, which only appears on older devices.",
             q="Which error code from the image decoder caused the recurring mobile crash?",
             ask="give the error code from the image decoder that caused the recurring mobile crash",
             expected=["4932"], avoid=[r"crash", r"decoder", r"mobile"]),
    ],
    "identifier": [
        dict(slug="fn-reconcile",
             plant="Billing investigation: the invoice rounding bug was traced to the function vt_reconcile_batch_v4, which rounds each line before summing instead of after.",
             q="Which function was the invoice rounding bug traced to?",
             ask="name the exact function that the invoice rounding bug was traced to",
             expected=["vt_reconcile_batch_v4"], avoid=[r"invoice", r"billing", r"function"]),
        dict(slug="env-spill",
             plant="Exporter runbook: to stop the log exporter from filling the disk, set the environment variable HARROW_SPILL_LIMIT before starting it, because the default is far too generous.",
             q="Which environment variable should be set to stop the log exporter from filling the disk?",
             ask="give the exact name of the environment variable that stops the log exporter from filling the disk",
             expected=["HARROW_SPILL_LIMIT"], avoid=[r"environment variable", r"exporter", r"\bdisk"]),
        dict(slug="host-replica",
             plant="Data platform note: the new staging replica for analysts lives on the host fennel-cache-23, and notebooks should point there instead of at production.",
             q="On which host does the new staging replica for analysts live?",
             ask="name the host on which the new staging replica for analysts lives",
             expected=["fennel-cache-23"], avoid=[r"replica", r"\bhosts?\b", r"analyst"]),
        dict(slug="flag-quorum",
             plant="Storage design decision: the new consensus change will ship behind the feature flag enable_lazy_quorum_probe, which stays off by default until the soak test passes.",
             q="What is the name of the feature flag that the storage team's consensus change will ship behind?",
             ask="give the exact name of the feature flag that the storage team's consensus change will ship behind",
             expected=["enable_lazy_quorum_probe"], avoid=[r"\bflag", r"storage", r"consensus"]),
        dict(slug="cfg-drift",
             plant="Scheduler fix: the guard against jobs running twice is controlled by the config key sched.overlap_fence_window, and it has to be set in every region.",
             q="Which config key controls the guard against scheduled jobs running twice?",
             ask="name the exact config key that controls the guard against scheduled jobs running twice",
             expected=["sched.overlap_fence_window"], avoid=[r"schedul", r"config key", r"twice"]),
        dict(slug="branch-ledger",
             plant="Finance systems hotfix: the fix for the ledger imbalance lives on the branch hotfix/ledger-skew-guard and needs two approvals before it merges.",
             q="What is the name of the branch that holds the fix for the ledger imbalance?",
             ask="give the exact name of the branch that holds the fix for the ledger imbalance",
             expected=["hotfix/ledger-skew-guard"], avoid=[r"branch", r"hotfix", r"ledger", r"finance"]),
        dict(slug="metric-backpressure",
             plant="Alerting change: the on-call dashboard now pages on the metric ingest_backpressure_wait_seconds instead of on raw queue depth.",
             q="Which metric does the on-call dashboard now page on instead of raw queue depth?",
             ask="name the exact metric that the on-call dashboard now pages on instead of raw queue depth",
             expected=["ingest_backpressure_wait_seconds"], avoid=[r"metric", r"on-call", r"queue"]),
        dict(slug="table-consent",
             plant="Privacy export: the consent report reads from the table acct_consent_ledger_hist, the only place where historical consent changes are kept.",
             q="Which database table does the consent report read from?",
             ask="give the exact name of the database table that the consent report reads from",
             expected=["acct_consent_ledger_hist"], avoid=[r"\btables?\b", r"consent", r"privacy"]),
        dict(slug="cli-drain",
             plant="Node rotation procedure: always run the deploy tool with the flag --drain-grace-window when rotating nodes out, so that in-flight requests can finish.",
             q="Which command-line flag should be passed to the deploy tool when rotating nodes out?",
             ask="name the exact command-line flag that should be passed to the deploy tool when rotating nodes out",
             expected=["drain-grace-window"], avoid=[r"\bflag", r"deploy tool", r"rotat"]),
        dict(slug="queue-deadletter",
             plant="Integrations note: failed webhooks are now moved to the queue wh_deadletter_morrow, where someone from the team replays them by hand each morning.",
             q="To which queue are failed webhooks now moved for manual replay?",
             ask="give the exact name of the queue that failed webhooks are now moved to for manual replay",
             expected=["wh_deadletter_morrow"], avoid=[r"queue", r"webhook", r"integration"]),
        dict(slug="bucket-quarry",
             plant="Storage note: raw ingest files are copied nightly into the bucket ingest-quarry-archive-east, which is the only copy kept beyond a week.",
             q="Into which bucket are raw ingest files copied nightly?",
             ask="name the exact bucket that raw ingest files are copied into nightly",
             expected=["ingest-quarry-archive-east"], avoid=[r"bucket", r"storage", r"archive"]),
    ],
    "name": [
        dict(slug="accessibility-head",
             plant="People update: the new head of the accessibility working group is Wilhelmina Ravensholt, who joins from the design system team.",
             q="Who is the new head of the accessibility working group?",
             ask="give the full name of the new head of the accessibility working group",
             expected=["Wilhelmina", "Ravensholt"], avoid=[r"accessib", r"design system"]),
        dict(slug="sre-offer",
             plant="Hiring update: the offer for the site reliability role was accepted by Ezinne Harkavy, who starts at the beginning of next month.",
             q="Who accepted the offer for the site reliability role?",
             ask="give the full name of the person who accepted the offer for the site reliability role",
             expected=["Ezinne", "Harkavy"], avoid=[r"\boffer", r"site reliability", r"hiring"]),
        dict(slug="customer-contact",
             plant="Account follow-up: the customer's new primary contact, replacing the champion who left, is Bartholomew Quist from their operations group.",
             q="Who is the customer's new primary contact, replacing the champion who left?",
             ask="give the full name of the customer's new primary contact who replaced the champion who left",
             expected=["Bartholomew", "Quist"], avoid=[r"champion", r"\bcontact", r"account"]),
        dict(slug="wizard-owner",
             plant="Ownership change: the account setup wizard is now owned by Saoirse Delacroix-Mbeki, who will also run the next round of usability interviews.",
             q="Who now owns the account setup wizard?",
             ask="give the full name of the person who now owns the account setup wizard",
             expected=["Saoirse", "Delacroix"], avoid=[r"wizard", r"onboarding", r"interview"]),
        dict(slug="exercise-commander",
             plant="Exercise planning: the incident commander for the next zone failure exercise will be Yevgenia Calloway from the reliability team.",
             q="Who will be the incident commander for the next zone failure exercise?",
             ask="give the full name of the incident commander for the next zone failure exercise",
             expected=["Yevgenia", "Calloway"], avoid=[r"exercise", r"incident commander", r"reliability"]),
        dict(slug="auditor",
             plant="Audit preparation: the external auditor assigned to our review this year is Obadiah Fairweather, and all evidence requests will come through him.",
             q="Who is the external auditor assigned to this year's review?",
             ask="give the full name of the external auditor assigned to this year's review",
             expected=["Obadiah", "Fairweather"], avoid=[r"audit", r"compliance"]),
        dict(slug="summit-keynote",
             plant="Summit programme: the opening keynote at the internal engineering summit will be given by Leocadia Brisbois, who led the storage rewrite.",
             q="Who will give the opening keynote at the internal engineering summit?",
             ask="give the full name of the person who will give the opening keynote at the internal engineering summit",
             expected=["Leocadia", "Brisbois"], avoid=[r"keynote", r"summit", r"storage"]),
        dict(slug="translation-coordinator",
             plant="Localisation staffing: translation reviews for the new markets will be coordinated by Cosimo Brathwaite, the contractor the team asked for.",
             q="Who will coordinate translation reviews for the new markets?",
             ask="give the full name of the person who will coordinate translation reviews for the new markets",
             expected=["Cosimo", "Brathwaite"], avoid=[r"translat", r"locali", r"contractor"]),
        dict(slug="deletion-lead",
             plant="Privacy staffing: the engineer leading the new deletion workflow project is Rosalind Oyelaran, who previously built the consent tooling.",
             q="Who is the engineer leading the new deletion workflow project?",
             ask="give the full name of the engineer leading the new deletion workflow project",
             expected=["Rosalind", "Oyelaran"], avoid=[r"privacy", r"deletion", r"consent"]),
        dict(slug="hackathon-prize",
             plant="Hackathon result: the people's choice prize went to Anatole Gushiken for a tool that turns long incident threads into a readable timeline.",
             q="Who won the people's choice prize at the hackathon?",
             ask="give the full name of the person who won the people's choice prize at the hackathon",
             expected=["Anatole", "Gushiken"], avoid=[r"hackathon", r"prize", r"incident"]),
    ],
    "string": [
        dict(slug="guest-wifi",
             plant="Offsite logistics: the guest wireless password at the venue is saffron-gull-meadow-17, so please do not post it in the public channel.",
             q="What is the guest wireless password at the offsite venue?",
             ask="write out the exact guest wireless password at the offsite venue",
             expected=["saffron-gull-meadow-17"], avoid=[r"offsite", r"password", r"wireless", r"venue"]),
        dict(slug="codename-permissions",
             plant="Planning note: the permissions rewrite will go by the codename Amber Kestrel in all internal planning documents until it is announced.",
             q="What codename will the permissions rewrite go by in internal planning documents?",
             ask="state the codename that the permissions rewrite will go by in internal planning documents",
             expected=["Amber Kestrel"], avoid=[r"codename", r"permission"]),
        dict(slug="council-motto",
             plant="Reliability council: for the coming quarter the council adopted the motto \"slow rollouts, quiet nights\" and will open every review by reading it aloud.",
             q="What motto did the reliability council adopt for the coming quarter?",
             ask="quote the exact motto the reliability council adopted for the coming quarter",
             expected=["slow rollouts", "quiet nights"], avoid=[r"motto", r"reliability council", r"rollout"]),
        dict(slug="drill-phrase",
             plant="Drill protocol: during practice events, the phrase \"marmalade thunder\" posted in the incident channel means the event is a rehearsal and not a real outage.",
             q="Which phrase posted in the incident channel signals that an event is only a rehearsal?",
             ask="quote the exact phrase that, posted in the incident channel, signals that an event is only a rehearsal",
             expected=["marmalade thunder"], avoid=[r"\bdrill", r"rehearsal", r"incident"]),
        dict(slug="release-name",
             plant="Release naming: the upcoming major release has been named Paper Orchard, and that name should be used in all customer-facing material.",
             q="What name has been given to the upcoming major release?",
             ask="state the name that has been given to the upcoming major release",
             expected=["Paper Orchard"], avoid=[r"release", r"\bnamed?\b"]),
        dict(slug="breakglass-phrase",
             plant="Security note: the break-glass passphrase for the emergency vault was reset to juniper-anvil-oracle-305 and is kept in the sealed envelope in the safe.",
             q="What is the break-glass passphrase for the emergency vault?",
             ask="write out the exact break-glass passphrase for the emergency vault",
             expected=["juniper-anvil-oracle-305"], avoid=[r"passphrase", r"vault", r"break-glass", r"secret", r"credential"]),
        dict(slug="talk-title",
             plant="Lunch and learn schedule: the next talk is titled \"Ghosts in the Retry Loop\" and covers what happens when clients retry without any backoff.",
             q="What is the title of the next lunch and learn talk?",
             ask="give the exact title of the next lunch and learn talk",
             expected=["Ghosts in the Retry Loop"], avoid=[r"lunch and learn", r"\btalk", r"retr(y|ies)"]),
        dict(slug="guild-room",
             plant="Room change: the architecture guild now meets in the room called the Quince Parlour, because its old room is being converted into phone booths.",
             q="What is the name of the room where the architecture guild now meets?",
             ask="give the name of the room where the architecture guild now meets",
             expected=["Quince Parlour"], avoid=[r"guild", r"architecture"]),
        dict(slug="sync-error-msg",
             plant="Desktop client bug: users who hit the sync bug see the message \"ledger handshake refused by peer\" in the status bar, with no further detail.",
             q="What exact message do users see in the status bar when they hit the sync bug?",
             ask="quote the exact message users see in the status bar when they hit the sync bug",
             expected=["ledger handshake refused by peer"], avoid=[r"\bsync\b", r"status bar", r"message"]),
        dict(slug="booth-tagline",
             plant="Events update: marketing settled on the tagline \"every query has a story\" for the trade show booth, after rejecting several louder options.",
             q="What tagline did marketing settle on for the trade show booth?",
             ask="quote the exact tagline marketing settled on for the trade show booth",
             expected=["every query has a story"], avoid=[r"tagline", r"trade show", r"marketing"]),
    ],
    "two-part": [
        dict(slug="captain-extension",
             plant=["Phone list update: Henrike Oduya's pager extension is 6294, and her old extension no longer rings.",
                    "Release planning: the release captain for this cycle is Henrike Oduya, who will also chair the final go or no-go call."],
             q="What is the pager extension of this cycle's release captain?",
             ask="state the pager extension of this cycle's release captain",
             expected=["6294"], avoid=[r"pager", r"extension", r"release captain", r"phone"]),
        dict(slug="replication-host-port",
             plant=["Replication setup: the new replication job should connect to the storage node birch-relay-09, which has the spare network capacity.",
                    "Storage networking: the replication listener has been moved to port 5871 on every storage node, and the old listener is being switched off."],
             q="Which host and which port should the new replication job connect to?",
             ask="state both the host and the port that the new replication job should connect to",
             expected=["birch-relay-09", "5871"], avoid=[r"\bports?\b", r"replicat", r"\bhosts?\b", r"storage"]),
        dict(slug="oncall-locker",
             plant=["Hardware keys: Ignatius Pemberton-Ruiz keeps the spare hardware security keys in locker 318, next to the printer.",
                    "Data team rota: the on-call lead for the data team this month is Ignatius Pemberton-Ruiz."],
             q="In which locker does this month's on-call lead for the data team keep the spare hardware security keys?",
             ask="say in which locker this month's on-call lead for the data team keeps the spare hardware security keys",
             expected=["318"], avoid=[r"locker", r"on-call", r"security key", r"data team"]),
        dict(slug="vendor-leadtime",
             plant=["Supplier details: Tallowmere Networks quoted a lead time of 113 days for delivery of the new load balancers.",
                    "Procurement decision: after the evaluation, the winning vendor for the load balancer refresh is Tallowmere Networks."],
             q="What lead time did the winning vendor for the load balancer refresh quote?",
             ask="state the lead time quoted by the winning vendor for the load balancer refresh",
             expected=["113"], avoid=[r"vendor", r"lead time", r"load balancer", r"procurement", r"supplier"]),
        dict(slug="reporting-user-vault",
             plant=["Reporting service config: in staging, the reporting service connects to the database as the user svc_lumen_ro.",
                    "Secrets layout: the reporting service reads its staging database credentials from the vault path kv/lumen/readonly-stage."],
             q="In staging, which database user does the reporting service connect as, and from which vault path does it read its credentials?",
             ask="give both the database user the reporting service connects as in staging and the vault path it reads its credentials from",
             expected=["svc_lumen_ro", "kv/lumen/readonly-stage"], avoid=[r"vault", r"credential", r"reporting service", r"secret"]),
        dict(slug="export-owner-host",
             plant=["Service inventory: the quarry-ledger service runs on the host larch-store-41, which is due for a hardware refresh later this year.",
                    "Ownership map: the service that owns the nightly export is called quarry-ledger."],
             q="On which host does the service that owns the nightly export run?",
             ask="name the host on which the service that owns the nightly export runs",
             expected=["larch-store-41"], avoid=[r"\bhosts?\b", r"export", r"inventory"]),
        dict(slug="allhands-dialin",
             plant=["All-hands logistics: the dial-in number for the quarterly all-hands is 8830.",
                    "Reminder for remote staff: the access code for the all-hands dial-in is 44172, and it is the same for every session."],
             q="What are the dial-in number and the access code for the quarterly all-hands?",
             ask="give both the dial-in number and the access code for the quarterly all-hands",
             expected=["8830", "44172"], avoid=[r"dial-in", r"all-hands", r"access code", r"remote"]),
        dict(slug="mentor-badge",
             plant=["Security desk: Casimir Etxeberria's building badge number is 30582, and replacement badges take a day to print.",
                    "Intern programme: the mentor assigned to this summer's intern cohort is Casimir Etxeberria."],
             q="What is the building badge number of the mentor assigned to this summer's intern cohort?",
             ask="state the building badge number of the mentor assigned to this summer's intern cohort",
             expected=["30582"], avoid=[r"badge", r"mentor", r"intern"]),
        dict(slug="archive-host-path",
             plant=["Cold storage: the cold archive lives on the host oriel-vault-62, which is only reachable from the operations network.",
                    "Backup layout: inside the cold archive, the quarterly snapshots are kept under the path /srv/archive/wren-quarterly."],
             q="On which host does the cold archive live, and under which path are the quarterly snapshots kept?",
             ask="give both the host of the cold archive and the path under which the quarterly snapshots are kept",
             expected=["oriel-vault-62", "srv/archive/wren-quarterly"], avoid=[r"archive", r"\bhosts?\b", r"snapshot", r"backup"]),
        dict(slug="codename-flag",
             plant=["Launch plan: Tin Cormorant will launch behind the feature flag billing_cormorant_gate, which finance can switch off on its own.",
                    "Billing planning: the billing rewrite has been given the codename Tin Cormorant."],
             q="Behind which feature flag will the billing rewrite launch?",
             ask="name the exact feature flag the billing rewrite will launch behind",
             expected=["billing_cormorant_gate"], avoid=[r"codename", r"\bflag", r"billing", r"finance", r"launch"]),
    ],
}

KINDS = ["number", "identifier", "name", "string", "two-part"]
KIND_ABBR = {"number": "num", "identifier": "ident", "name": "name",
             "string": "str", "two-part": "two"}
# Per length: every kind twice plus two extras (rotating).
EXTRAS = {256: ["number", "identifier"], 512: ["name", "string"],
          1024: ["two-part", "number"], 1800: ["identifier", "two-part"]}
# 6 (position, switch) slots; consecutive slots differ in both.
SLOTS = [("start", "first"), ("middle", "mid"), ("end", "first"),
         ("start", "mid"), ("middle", "first"), ("end", "mid")]

PREAMBLES = [
    "First write two sentences about the overall mood of these notes, then {ask}.",
    "Begin with a short summary, two or three sentences long, of which teams appear in these notes. After that, {ask}.",
    "Before anything else, describe in two sentences the kinds of problems these teams are dealing with. Only then {ask}.",
    "Start by writing two sentences on what kind of document this seems to be and who would read it; then {ask}.",
    "First name two topics discussed in the notes, with one full sentence on each, and afterwards {ask}.",
    "Open with two sentences giving your impression of how organised these teams seem. Then, in a new sentence, {ask}.",
    "Write a brief two-sentence summary of the notes first. Once that is done, {ask}.",
    "First explain in two sentences which decision in these notes seems most consequential, and only after that {ask}.",
]
FIRST_SUFFIX = " Answer in one full sentence."


def note_style(plant):
    """'Label: the text' -> 'Label. The text', matching the filler style."""
    label, sep, rest = plant.partition(": ")
    if sep and len(label.split()) <= 5:
        return f"{label}. {rest[0].upper()}{rest[1:]}"
    return plant


def words(text):
    return len(text.split())


def target_words(length):
    return round(length / TOKENS_PER_WORD)


def eligible_filler(fact):
    pats = [re.compile(p, re.I) for p in fact["avoid"]]
    out = []
    for i, p in enumerate(FILLER):
        if any(r.search(p) for r in pats):
            continue
        if any(e.lower() in p.lower() for e in fact["expected"]):
            continue
        out.append(i)
    return out


def pick_filler(rng, pool, need, used):
    """Choose paragraph indices whose word total is as close as possible to
    `need` (several seeded greedy passes; the closest wins, ties -> first)."""
    hi = need * (1 + WORD_TOL)
    best = None
    for _attempt in range(60):
        order = pool[:]
        rng.shuffle(order)
        chosen, total = [], 0
        for idx in order:
            w = words(FILLER[idx])
            if total + w <= hi:
                chosen.append(idx)
                total += w
            if total >= need - 20:
                break
        if frozenset(chosen) in used:   # every item gets its own filler set
            continue
        if best is None or abs(total - need) < abs(best[1] - need):
            best = (chosen, total)
    used.add(frozenset(best[0]))
    return best[0]


def rel_pos(paras, para_idx, needle):
    """Relative word position of `needle` inside paragraph para_idx."""
    before = sum(words(p) for p in paras[:para_idx])
    para = paras[para_idx]
    char = para.lower().index(needle.lower())
    before += words(para[:char])
    return before / sum(words(p) for p in paras)


def build_context(rng, filler_idx, plant_a, needle, position, plant_b=None,
                  b_where=None):
    paras = [FILLER[i] for i in filler_idx]
    if plant_b is not None:
        paras.insert(0 if b_where == "start" else len(paras), plant_b)
    n = len(paras)
    cands = []
    for k in range(n + 1):
        trial = paras[:k] + [plant_a] + paras[k:]
        r = rel_pos(trial, k, needle)
        if plant_b is not None:  # keep part A clear of part B
            if b_where == "start" and k == 0:
                continue
            if b_where == "end" and k == n:
                continue
        ok = {"start": r <= 0.10, "end": r >= 0.90,
              "middle": 0.42 <= r <= 0.58}[position]
        if ok:
            cands.append(k)
    if not cands:
        if position == "start":
            cands = [1 if (plant_b is not None and b_where == "start") else 0]
        elif position == "end":
            cands = [n - 1 if (plant_b is not None and b_where == "end") else n]
        else:
            best = min(range(1, n), key=lambda k: abs(
                rel_pos(paras[:k] + [plant_a] + paras[k:], k, needle) - 0.5))
            cands = [best]
    k = rng.choice(cands)
    paras = paras[:k] + [plant_a] + paras[k:]
    return paras, k


def plan():
    """Return list of (length, kind, position, switch) in a balanced layout.

    Per length: 12 kinds (each twice plus two extras) and 12 (position,
    switch) slots (each of the 6 combinations twice).  Slots are assigned to
    kinds by a small seeded hill-climb that balances kind x position,
    kind x switch and kind x position x switch over the whole set.
    """
    per_len = {}
    for li, length in enumerate(LENGTHS):
        kinds = KINDS + KINDS + EXTRAS[length]
        per_len[length] = (kinds, SLOTS + SLOTS)

    def cost(assign):
        kp, ks, kps = collections.Counter(), collections.Counter(), collections.Counter()
        for length in LENGTHS:
            kinds, _ = per_len[length]
            for kind, (pos, sw) in zip(kinds, assign[length]):
                kp[kind, pos] += 1
                ks[kind, sw] += 1
                kps[kind, pos, sw] += 1
        c = 0.0
        for kind in KINDS:
            n = sum(kp[kind, p] for p in ("start", "middle", "end"))
            c += sum((kp[kind, p] - n / 3) ** 2 for p in ("start", "middle", "end"))
            c += sum((ks[kind, w] - n / 2) ** 2 for w in ("first", "mid"))
            c += 0.5 * sum((kps[kind, p, w] - n / 6) ** 2
                           for p in ("start", "middle", "end") for w in ("first", "mid"))
        # the two copies of a kind within one length should differ in slot
        for length in LENGTHS:
            kinds, _ = per_len[length]
            seen = collections.Counter(zip(kinds, assign[length]))
            c += 10 * sum(v - 1 for v in seen.values() if v > 1)
        return c

    rng = random.Random(SEED + "/plan")
    assign = {length: list(per_len[length][1]) for length in LENGTHS}
    for length in LENGTHS:
        rng.shuffle(assign[length])
    best = cost(assign)
    for _ in range(6000):
        length = rng.choice(LENGTHS)
        i, j = rng.sample(range(12), 2)
        a = assign[length]
        a[i], a[j] = a[j], a[i]
        c = cost(assign)
        if c <= best:
            best = c
        else:
            a[i], a[j] = a[j], a[i]
    out = []
    for length in LENGTHS:
        kinds, _ = per_len[length]
        for kind, (pos, sw) in zip(kinds, assign[length]):
            out.append((length, kind, pos, sw))
    return out


def generate():
    layout = plan()
    fact_iter = {k: iter(v) for k, v in FACTS.items()}
    items = []
    counters = collections.Counter()
    mid_count = 0
    two_mid_toggle = 0
    used_filler = set()
    for (length, kind, position, switch) in layout:
        fact = next(fact_iter[kind])
        base = f"{KIND_ABBR[kind]}-{length}-{position}"
        counters[base] += 1
        item_id = f"{base}-{fact['slug']}"
        rng = random.Random(f"{SEED}/{item_id}")
        if kind == "two-part":
            plant_a, plant_b = map(note_style, fact["plant"])
            if position == "start":
                b_where = "end"
            elif position == "end":
                b_where = "start"
            else:
                b_where = ["start", "end"][two_mid_toggle % 2]
                two_mid_toggle += 1
            plant_words = words(plant_a) + words(plant_b)
        else:
            plant_a, plant_b, b_where = note_style(fact["plant"]), None, None
            plant_words = words(plant_a)
        need = target_words(length) - plant_words
        filler_idx = pick_filler(rng, eligible_filler(fact), need, used_filler)
        paras, a_idx = build_context(rng, filler_idx, plant_a,
                                     fact["expected"][0], position,
                                     plant_b, b_where)
        context = "\n\n".join(paras)
        if switch == "first":
            question = fact["q"] + FIRST_SUFFIX
        else:
            question = PREAMBLES[mid_count % len(PREAMBLES)].format(ask=fact["ask"])
            mid_count += 1
        item = {
            "id": item_id, "kind": kind, "length": length,
            "position": position, "switch": switch,
            "context": context, "question": question,
            "expected": fact["expected"],
        }
        meta = {"filler": filler_idx, "paras": paras, "a_idx": a_idx,
                "plants": [plant_a] + ([plant_b] if plant_b else []),
                "b_where": b_where}
        items.append((item, meta))
    return items


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------
def check_filler():
    assert len(FILLER) >= 60, len(FILLER)
    assert len(set(FILLER)) == len(FILLER), "duplicate filler paragraph"
    for i, p in enumerate(FILLER):
        w = words(p)
        assert 40 <= w <= 110, (i, w, p[:60])
        assert not re.search(r"\d", p), ("digit in filler", i)
        # Capitalised words not at a sentence start: would be proper names.
        for m in re.finditer(r"\b[A-Z][a-zA-Z]+", p):
            pre = p[:m.start()].rstrip()
            if pre == "" or pre[-1] in ".:;!?\"":
                continue
            raise AssertionError(f"possible proper name {m.group()!r} in filler {i}")


def check_items(items):
    ids = [it["id"] for it, _ in items]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert len(items) >= 48
    # uniqueness of fact values across items
    all_vals = [e.lower() for it, _ in items for e in it["expected"]]
    assert len(all_vals) == len(set(all_vals)), "expected values not unique"
    seen_filler = set()
    per_len = collections.Counter(it["length"] for it, _ in items)
    for length in LENGTHS:
        assert per_len[length] >= 12, (length, per_len[length])
    for it, meta in items:
        ctx, ctx_l = it["context"], it["context"].lower()
        blob = (ctx + " " + it["question"]).lower()
        for t in TAKEN:
            assert t.lower() not in blob, (it["id"], "taken wording", t)
        for e in it["expected"]:
            assert e in ctx, (it["id"], "expected not verbatim in context", e)
            assert e.lower() not in it["question"].lower(), (it["id"], "question leaks", e)
            if e.isdigit():
                n = len(re.findall(rf"(?<!\d){e}(?!\d)", ctx))
                assert n == 1, (it["id"], "number appears", n)
        # other items' values must not appear in this context
        own = {e.lower() for e in it["expected"]}
        for v in all_vals:
            if v not in own:
                assert v not in ctx_l, (it["id"], "foreign value", v)
        # filler hygiene
        filler_text = "\n".join(FILLER[i] for i in meta["filler"]).lower()
        assert not re.search(r"\d", filler_text)
        for e in it["expected"]:
            assert e.lower() not in filler_text, (it["id"], "expected in filler", e)
            for part in re.split(r"[\s\-_/.,]+", e.lower()):
                if len(part) >= 5 and it["kind"] in ("name",):
                    assert part not in filler_text, (it["id"], "name part in filler", part)
        key = frozenset(meta["filler"])
        assert key not in seen_filler, (it["id"], "filler identical to another item")
        seen_filler.add(key)
        # length
        tw = target_words(it["length"])
        w = words(ctx)
        assert abs(w - tw) <= tw * WORD_TOL_HARD, (it["id"], w, tw)
        # position of part A's value
        r = rel_pos(meta["paras"], meta["a_idx"], it["expected"][0])
        lim = {"start": r <= 0.12, "end": r >= 0.85, "middle": 0.35 <= r <= 0.65}
        assert lim[it["position"]], (it["id"], it["position"], round(r, 3))
        if it["kind"] == "two-part":
            b_idx = meta["paras"].index(meta["plants"][1])
            rb = sum(words(p) for p in meta["paras"][:b_idx]) / w
            assert abs(rb - r) >= 0.3, (it["id"], "two parts too close", r, rb)
        # questions
        q = it["question"]
        if it["switch"] == "first":
            assert q.endswith("Answer in one full sentence."), it["id"]
        else:
            assert "first" in q.lower() or "begin" in q.lower() or \
                "start" in q.lower() or "before" in q.lower() or \
                "open with" in q.lower(), it["id"]
    # balance
    for length in LENGTHS:
        sub = [it for it, _ in items if it["length"] == length]
        pc = collections.Counter(it["position"] for it in sub)
        sc = collections.Counter(it["switch"] for it in sub)
        assert max(pc.values()) - min(pc.values()) <= 1, (length, pc)
        assert max(sc.values()) - min(sc.values()) <= 1, (length, sc)
    kc = collections.Counter(it["kind"] for it, _ in items)
    assert max(kc.values()) - min(kc.values()) <= 2, kc
    for kind in KINDS:
        sub = [it for it, _ in items if it["kind"] == kind]
        assert {it["switch"] for it in sub} == {"first", "mid"}, kind
        assert {it["position"] for it in sub} == {"start", "middle", "end"}, kind


def crosstab(items, a, b):
    order = {v: i for i, v in enumerate(LENGTHS + KINDS + ["start", "middle", "end", "first", "mid"])}
    rows = sorted({it[a] for it, _ in items}, key=order.get)
    cols = sorted({it[b] for it, _ in items}, key=order.get)
    c = collections.Counter((it[a], it[b]) for it, _ in items)
    width = max(len(str(x)) for x in rows + [a]) + 2
    head = a + " x " + b
    lines = [f"{head:<{width + 4}}" + "".join(f"{str(x):>11}" for x in cols) + f"{'total':>9}"]
    for r in rows:
        lines.append(f"{str(r):<{width + 4}}" + "".join(f"{c[(r, x)]:>11}" for x in cols)
                     + f"{sum(c[(r, x)] for x in cols):>9}")
    return "\n".join(lines)


def summary(items):
    print(f"{len(items)} items, {len(FILLER)} filler paragraphs "
          f"({min(map(words, FILLER))}-{max(map(words, FILLER))} words each)\n")
    print(crosstab(items, "length", "kind"), "\n")
    print(crosstab(items, "length", "position"), "\n")
    print(crosstab(items, "length", "switch"), "\n")
    print(crosstab(items, "kind", "position"), "\n")
    print(crosstab(items, "kind", "switch"), "\n")
    print(f"{'id':<44} {'words':>6} {'target':>6} {'~tokens':>8} {'paras':>5} {'posA':>5}")
    for it, meta in items:
        w = words(it["context"])
        r = rel_pos(meta["paras"], meta["a_idx"], it["expected"][0])
        print(f"{it['id']:<44} {w:>6} {target_words(it['length']):>6} "
              f"{round(w * TOKENS_PER_WORD):>8} {len(meta['paras']):>5} {r:>5.2f}")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(here, "..", "benches", "recall", "items.jsonl")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--check", action="store_true", help="build and assert only")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    check_filler()
    items = generate()
    if not args.quiet:
        summary(items)
    check_items(items)
    if args.check:
        print("\nchecks passed (nothing written)")
        return
    out = os.path.normpath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for it, _ in items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    print(f"\nwrote {len(items)} items to {out}")


if __name__ == "__main__":
    main()
