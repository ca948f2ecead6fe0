"""The one number the agent's and the aggregator's size limits come from: the largest report body.

The aggregator refuses a request body over ``REPORT_MAX_BYTES`` (its ``max_body_bytes`` default)
with 413, and a report of more than ``REPORT_MAX_EVENTS`` events with 400. The agent builds every
report within both, carrying a backlog of events over as many
reports as it takes, oldest first, and keeps at most ``PENDING_EVENTS_MAX_BYTES`` of events while
the aggregator cannot take them. This module imports nothing, so either service may use it.
"""

from __future__ import annotations

# 1 MiB. An 8-GPU, 8-HCA node's report without events is ~28 KiB (bench_ingest), so one report
# could carry ~7,000 Xid events of ~140 bytes by size; the count limit below stops it first.
REPORT_MAX_BYTES = 1 << 20

# Events in one report: the aggregator's schema refuses more (400), and the agent stops filling
# a report at this count as well as at REPORT_MAX_BYTES. 4,096 Xid events are ~0.6 MiB, so both
# limits bound the same scale of report; a 9,216-event flood goes out in three reports.
REPORT_MAX_EVENTS = 4096

# Events the agent holds while the aggregator is unreachable, as the bytes they are sent as: 16
# full reports, sent back to back once it answers again. The worst flood on record (issue 13:
# 9,216 Xid events in a minute, 1.3 MB) fills it in ~12 minutes; a node's ordinary events (a few
# per day) in years. Events are held serialized (~1.4x their size in memory, against ~5x as
# objects), so a full backlog costs ~24 MiB of the agent's 256 MiB limit.
PENDING_EVENTS_MAX_BYTES = 16 * REPORT_MAX_BYTES
