"""DCP's file writer with writer threads whose failures fail the save.

torch 2.13's FileSystemWriter(thread_count=N) starts N-1 extra threads; when one fails (a full
disk, say) its traceback is printed by the thread and its files are silently left out of the
save. Here every writer runs torch's own single-threaded write in a thread of ours, which keeps
the error: the first one is raised from `write_data`, so DCP fails the save on every rank.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.futures import Future


class Writer(dcp.FileSystemWriter):
    def _write_data(self, planner: Any, file_queue: queue.Queue) -> Future:
        threads, self.thread_count = (
            self.thread_count,
            1,
        )  # torch's writer: no threads of its own
        results: list[Any] = []
        errors: list[BaseException] = []

        def write() -> None:
            try:
                results.extend(
                    super(Writer, self)._write_data(planner, file_queue).wait()
                )
            except BaseException as error:  # noqa: BLE001 - handed to the caller below
                errors.append(error)
                while True:  # the other writers must not pick up this writer's share
                    try:
                        file_queue.get_nowait()
                    except queue.Empty:
                        break

        try:
            extra = [
                threading.Thread(target=write, name=f"checkpoint-writer-{i}")
                for i in range(1, threads)
            ]
            for thread in extra:
                thread.start()
            write()
            for thread in extra:
                thread.join()
        finally:
            self.thread_count = threads
        if errors:
            raise errors[0]
        done: Future = Future()
        done.set_result(results)
        return done
