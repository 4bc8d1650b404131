"""The server's log lines: one per record on stderr, as text or one JSON object per line,
stamped in UTC to the millisecond in ISO 8601 (`2026-12-04T14:42:23.123Z`).

UTC, because lines from replicas and nodes in different zones are read side by side; the
millisecond, because a push, its ACK and the next push are often within one second.
"""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["JsonFormatter", "TextFormatter", "configure_logging", "utc_timestamp"]


def utc_timestamp(created: float) -> str:
    """`created` (seconds since the epoch) as `YYYY-MM-DDTHH:MM:SS.mmmZ`, truncated to the
    millisecond."""
    seconds = int(created)
    millis = min(999, int((created - seconds) * 1000))
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(seconds))}.{millis:03d}Z"


class TextFormatter(logging.Formatter):
    """`<UTC time> <LEVEL> <logger>: <message>`, the traceback on the lines after."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_timestamp(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines: ts, level, logger, message, and
    exception when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": utc_timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, fmt: str) -> None:
    """Send every record at `level` or above to stderr, as `fmt` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
