"""The signals that end a server: every one drains within --drain-timeout, then exits 0 (docs/SERVING.md,
"Lifecycle"). SIGHUP comes from a closed terminal, SIGUSR1 from operators' scripts; left to their default
action they killed both servers mid-stream (exit 129 / 138), with no `data: [DONE]` and files left behind."""

from __future__ import annotations

import signal

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
