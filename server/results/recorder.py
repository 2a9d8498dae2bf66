"""What a run leaves behind: every request, every step, and the clock time each step ended."""

from __future__ import annotations

import time
from collections.abc import Sequence

from batchsim.scheduler.plan import StepPlan, StepResult
from batchsim.scheduler.request import Request, RequestStatus
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.results.json_lines import run_items
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.run_files import RecordStream
from batchsim.server.results.spec_metrics import SpecCounts

# A record's status by the request's (built once: an Enum class's attribute reads cost ~0.4 us).
_STATUS_NAMES = {RequestStatus.FINISHED: "finished", RequestStatus.REJECTED: "rejected",
                 RequestStatus.ABORTED: "aborted"}


class RunRecorder:
    def __init__(self, stream: RecordStream | None = None) -> None:
        self.requests: dict[int, Request] = {}  # every request seen, in arrival order
        self.step_end_s: list[float] = []  # end time of each executed step, by scheduler step index
        self.steps: list[StepRecord] = []
        self.kv_account_mismatches = 0  # steps where executor and scheduler disagreed on KV bytes
        self.spec = SpecCounts()  # speculative decoding's drafts and acceptance
        self.num_left = 0  # requests that left the engine (finished, rejected or aborted)
        self._preemptions_seen = 0
        self._stream = stream  # the run directory's files, appended as the run goes
        self._final: dict[int, RequestRecord] = {}  # records of requests that left the engine
        self._arrivals = None if stream is None else stream.arrivals  # ids, in arrival order
        if stream is not None:  # its records' token runs index these
            stream.follow_ends(self.step_end_s)

    def on_arrival(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self._arrivals is not None:
            self._arrivals.append(request.request_id)

    def on_step(
        self, plan: StepPlan, result: StepResult, start_s: float, ends_s: Sequence[float],
        scheduler: Scheduler,
    ) -> None:
        self.step_end_s.extend(ends_s)
        # unpacked once (a named tuple's field read is an unspecialized attribute load): per plan
        step_index, _, new_requests, prefills, decode_ids, _, pool, kv_bytes, _, _, _, _ = plan
        _, _, _, durations, kv_bytes_measured, _, drafted = result
        if kv_bytes_measured != kv_bytes:
            self.kv_account_mismatches += 1
        if drafted is not None:
            self.spec.add(result)
        # most plans have none or one chunk: their tokens without a list
        prefill_tokens = (prefills[0].num_tokens if len(prefills) == 1
                          else sum([c.num_tokens for c in prefills]) if prefills else 0)
        preempted = scheduler.num_preemptions - self._preemptions_seen
        self._preemptions_seen = scheduler.num_preemptions
        rows, capacity_tokens, _ = pool
        step = StepRecord(  # positional, in field order: one is built per plan
            step_index,
            start_s,
            ends_s[-1],
            len(ends_s),
            len(decode_ids),
            prefill_tokens,
            len(prefills),
            len(scheduler.running),
            len(scheduler.waiting),
            kv_bytes,
            kv_bytes_measured,
            rows,
            capacity_tokens,
            preempted,
            sum(durations),  # result.elapsed_s, without the property's frame
            len(new_requests),
        )
        self.steps.append(step)
        if self._stream is not None:
            self._stream.add_step(step)

    def on_finish(self, request: Request) -> None:
        """The request left the engine (finished, rejected or aborted): its record is final and
        goes to the run directory (without one, records are built at the end)."""
        self.num_left += 1
        if self._stream is None:
            return
        t0 = time.perf_counter()
        record = self.record(request)
        self._final[request.request_id] = record
        self._stream.add_request(record, request.token_runs)
        self._stream.writing_s += time.perf_counter() - t0

    def token_times(self, request: Request) -> tuple[float, ...]:
        return tuple(run_items(self.step_end_s, request.token_runs))

    def request_records(self) -> list[RequestRecord]:
        final = self._final
        return [final.get(r.request_id) or self.record(r) for r in self.requests.values()]

    def record(self, r: Request) -> RequestRecord:
        return RequestRecord(  # positional, in field order: one a request (keywords cost 30%)
            r.request_id,
            _STATUS_NAMES.get(r.status, "unfinished"),
            r.arrival_s,
            r.first_scheduled_s,
            self.token_times(r),
            r.finished_s,
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.num_preemptions,
            r.finish_reason,
        )
