"""Streaming generation: one thread owns a vLLM engine and runs the batches of several steps at once.

``vllm.LLM.generate`` is a barrier: it adds one batch's requests and steps the engine until
all of them finish, so while the longest responses of a batch decode, the slots the short ones
left stay empty. Under max_staleness k the batches of the next k steps are already known, so
the generator streams instead (``Generator(streaming=True)``): every batch's requests go into
one engine as they arrive, and its continuous batching fills the freed slots with the next
batches' requests. What vLLM 0.32 offers for this, read from its source
(vllm/v1/engine/llm_engine.py, vllm/entrypoints/common/offline.py):

* ``LLMEngine.add_request(request_id, prompt, params, lora_request=)`` queues a request (n > 1
  fans out into child requests, reported together under the parent's id), and
  ``LLMEngine.step()`` runs one scheduler step and returns the outputs; with
  ``RequestOutputKind.FINAL_ONLY`` only finished requests report, once, under the id they were
  added with. ``LLM.generate`` is this loop run to the end for one batch.
* The engine is not thread-safe: here one thread (``EngineLoop``'s) makes every engine call.
  Other threads (the Ray actor's calls, ``max_concurrency`` > 1) hand it work through a queue
  and wait on a future: a batch's requests, an adapter load, anything else that touches the
  engine, which runs between two steps, never during one.
* On the CPU a seeded request whose prefill is chunked crashes the runner, and with requests
  arriving while others decode the scheduler would chunk: the streaming engine is built with
  ``enable_chunked_prefill=False`` (the scheduler then waits for room instead).

What a batch samples does not depend on what it shares the engine with beyond float rounding:
every request has its own seed, and the batch composition of a step changes its logprobs by
~2e-6 on the tiny model (tests/test_generator.py), never its tokens in the cases measured.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

_STOP = object()


class EngineLoop:
    """The thread that owns `engine` (a vllm LLMEngine): it runs the calls queued by other
    threads between engine steps, and steps the engine while any request is unfinished,
    handing each batch its outputs when its last request finishes."""

    def __init__(self, engine, name: str = "ppo-ray-engine"):
        self.engine = engine
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._batches: dict[str, tuple[list[str], dict[str, Any], Future]] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self.peak_batches = 0  # the most batches in the engine at one step (a test reads it)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ other threads
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine's thread, between two steps; its result (or its exception)."""
        future: Future = Future()
        self._calls.put((fn, future))
        return future.result()

    def run(self, requests: Sequence[tuple[Any, Any, Any]]) -> list:
        """Run `requests` [(prompt, SamplingParams, lora_request)] in the engine with whatever else
        is running; their final RequestOutputs, in order. SamplingParams must report
        FINAL_ONLY."""
        batch = f"b{next(self._ids)}"
        ids = [f"{batch}-{i}" for i in range(len(requests))]
        done: Future = Future()

        def add() -> None:
            self._batches[batch] = (ids, {}, done)
            added: list[str] = []
            try:
                for request_id, (prompt, params, lora_request) in zip(ids, requests):
                    self.engine.add_request(request_id, prompt, params, lora_request=lora_request)
                    added.append(request_id)
            except BaseException:
                if added:
                    self.engine.abort_request(added)
                del self._batches[batch]
                raise

        self.call(add)
        return done.result()

    def idle(self) -> bool:
        """Whether no request is in the engine (on the engine's thread: exact)."""
        return not self.engine.has_unfinished_requests()

    def close(self) -> None:
        """Stop the thread (batches still running fail)."""
        if self._thread.is_alive():
            self._calls.put(_STOP)
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the engine's thread
    def _run(self) -> None:
        while True:
            block = self._dead is not None or not self.engine.has_unfinished_requests()
            try:
                item = self._calls.get(block=block)
            except queue.Empty:
                item = None
            while item is not None:  # every call queued so far, then one step
                if item is _STOP:
                    self._fail(RuntimeError("the generator's engine loop was closed"))
                    return
                fn, future = item
                if self._dead is not None:
                    future.set_exception(RuntimeError(f"the vLLM engine failed earlier: {self._dead!r}"))
                else:
                    try:
                        future.set_result(fn())
                    except BaseException as error:  # noqa: BLE001 - handed to the caller
                        future.set_exception(error)
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    item = None
            if self._dead is not None or not self.engine.has_unfinished_requests():
                continue
            self.peak_batches = max(self.peak_batches, len(self._batches))
            try:
                outputs = self.engine.step()
            except BaseException as error:  # noqa: BLE001 - the engine is dead: every waiting batch fails
                self._dead = error
                self._fail(RuntimeError(f"the vLLM engine failed while generating: {error!r}"))
                continue
            for output in outputs:
                if output.finished:
                    self._finished(output)

    def _finished(self, output) -> None:
        batch = output.request_id.rsplit("-", 1)[0]
        ids, outputs, done = self._batches[batch]
        outputs[output.request_id] = output
        if len(outputs) == len(ids):
            del self._batches[batch]
            done.set_result([outputs[i] for i in ids])

    def _fail(self, error: BaseException) -> None:
        for _, _, done in self._batches.values():
            done.set_exception(error)
        self._batches.clear()
