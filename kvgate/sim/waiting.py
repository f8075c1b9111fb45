"""The engine's waiting queue, in vLLM V1's two orders (`vllm/v1/core/sched/request_queue.py`).

- `fcfs`: arrival order; a preempted request goes back to the *front*.
- `priority`: lowest `(priority, arrival_time, request_id)` first, as vLLM's `Request.__lt__`
  orders its heap; a preempted request simply rejoins the order (there is no front).

Iteration yields requests in the order they would be scheduled.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from kvgate.sim.request import SimRequest

POLICIES = ("fcfs", "priority")


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy: {policy!r} is not one of {POLICIES}")
        self.policy = policy
        self._fifo: deque[SimRequest] = deque()
        self._heap: list[tuple[int, float, str, SimRequest]] = []

    def append(self, request: SimRequest) -> None:
        if self.policy == "fcfs":
            self._fifo.append(request)
        else:
            heapq.heappush(self._heap, _key(request))

    def prepend(self, request: SimRequest) -> None:
        """A preempted request: the front under fcfs, its own place under priority."""
        if self.policy == "fcfs":
            self._fifo.appendleft(request)
        else:
            heapq.heappush(self._heap, _key(request))

    def peek(self) -> SimRequest:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> SimRequest:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, request: SimRequest) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            self._heap = [item for item in self._heap if item[3] is not request]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[SimRequest]:
        if self.policy == "fcfs":
            return iter(list(self._fifo))
        return (item[3] for item in sorted(self._heap))


def _key(request: SimRequest) -> tuple[int, float, str, SimRequest]:
    return (request.priority, request.arrival_time, request.request_id, request)
