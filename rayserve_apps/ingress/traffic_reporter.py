"""The ingress's side of the live statistics: buffer one record per request, push them to the controller.

Every ingress replica pushes its own records (a pull by the controller would reach only one replica of a
replicated ingress). A report that fails (the controller restarting) is kept and sent with the next one, up to
`MAX_BUFFERED_RECORDS`; the oldest are dropped beyond that, so a missing controller never grows the ingress.
"""

from __future__ import annotations

import asyncio
import logging

from ray.serve.handle import DeploymentHandle

from placement.core.traffic_window import RequestRecord

logger = logging.getLogger("ray.serve")

#: Most records an ingress replica holds while the controller does not take them.
MAX_BUFFERED_RECORDS = 100_000


class TrafficReporter:
    def __init__(self, controller: DeploymentHandle, period_s: float):
        self.controller = controller
        self.period_s = period_s
        self.buffer: list[RequestRecord] = []
        self._task: asyncio.Task | None = None

    def add(self, record: RequestRecord) -> None:
        self.buffer.append(record)
        if len(self.buffer) > MAX_BUFFERED_RECORDS:
            del self.buffer[: len(self.buffer) - MAX_BUFFERED_RECORDS]
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.buffer:
            await asyncio.sleep(self.period_s)
            batch, self.buffer = self.buffer, []
            try:
                await self.controller.report.remote([r.to_json() for r in batch])
            except Exception as error:  # noqa: BLE001 - the controller may be restarting; keep the records
                logger.warning("traffic report to the placement controller failed (%s); will retry",
                               type(error).__name__)
                self.buffer = batch + self.buffer
