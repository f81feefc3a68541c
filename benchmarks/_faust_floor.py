"""faust's own floor, for ``streams_throughput.py --engines ...,faust-floor``.

The app ``guard streams`` builds for faust (same settings, event loop and topics, the same
``stream.take_events(batch_max, batch_within_s)`` batches), with an agent that only
JSON-decodes each record and counts it: no schema, no detection, no output. Its rate is what
any faust worker on this machine could reach through faust's stream API; a ratio of it to the
bare confluent-kafka loop bounds the faust worker's. Progress lines as ``guard streams``
writes them (to stderr, every ``streams.progress_s``). Settings from ``GUARD_*``.
"""

from __future__ import annotations

import sys
from typing import Any

import faust
import orjson

from guard.config import load_settings
from guard.streams.faust_app import RAW, _faust_app, _use_uvloop
from guard.streams.processing import progress_line, topic_kinds


def main() -> None:
    settings = load_settings()
    st = settings.streams
    _use_uvloop()  # as create_app
    app = _faust_app(settings)
    loads = orjson.loads
    seen = [0]

    async def telemetry(stream: Any) -> None:
        async for events in stream.take_events(st.batch_max, st.batch_within_s):
            for event in events:
                loads(event.value)
            seen[0] += len(events)

    app.agent(app.topic(*topic_kinds(settings.topic), **RAW), name="telemetry")(telemetry)

    @app.timer(interval=st.progress_s)  # type: ignore[misc]
    async def progress() -> None:
        print(progress_line("streams", telemetry=seen[0]), file=sys.stderr, flush=True)

    faust.Worker(
        app, loglevel="warning", quiet=True, redirect_stdouts=False
    ).execute_from_commandline()


if __name__ == "__main__":
    main()
