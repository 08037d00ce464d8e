"""Prompt prefetch: the next prompts are prepared on a background thread while the current step
runs.

Preparing a prompt (``task.prompt(i)``: reading a row, rendering a chat template, tokenizing)
can be slow for a user's dataset. A :class:`PromptPrefetcher` prepares prompt samples
(:func:`~hybridrl.protocol.prompt_sample`) by stream index: asking for index ``i`` (or the
indices ``i .. i+n-1``) returns them and queues the next ``ahead`` indices for the thread. A
prompt is a pure function of its index, so the samples are the same, in the same order, as
without prefetch, and a resumed run (which starts at its checkpoint's cursor) continues exactly.

One worker thread prepares every prompt, in index order, so ``task.prompt`` is never called from
two threads at once. An index nobody queued (the first, a prompt handed out again after a
resume) is prepared on that thread too, ahead of the queue's later work only in that it is
awaited first. A prompt source that raises makes the request for that index raise the same
exception at once (never a hang); a failure of a look-ahead index that is never asked for stays
silent. ``ahead=0`` prepares each prompt when it is asked for, on the caller's thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from hybridrl.protocol import Sample, prompt_sample


class PromptPrefetcher:
    """Prompt samples of ``task`` (encoded with ``tokenizer``) by stream index, prepared up to
    ``ahead`` indices in advance of the last one asked for."""

    def __init__(self, task, tokenizer, ahead: int):
        if ahead < 0:
            raise ValueError(f"PromptPrefetcher: ahead must be >= 0, got {ahead}")
        self.task, self.tokenizer, self.ahead = task, tokenizer, ahead
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prompt-prefetch") if ahead else None
        self.queued: dict[int, Future] = {}

    def make(self, index: int) -> Sample:
        """The prompt sample of stream position ``index`` (what the drivers made without
        prefetch)."""
        return prompt_sample(self.task.prompt(index), self.tokenizer)

    def get(self, index: int) -> Sample:
        return self.take(index, 1)[0]

    def take(self, start: int, n: int) -> list[Sample]:
        """The prompt samples of indices ``start .. start+n-1``; queues the ``ahead`` after them.
        Raises the prompt source's own exception for the first index that failed."""
        if self.pool is None:
            return [self.make(i) for i in range(start, start + n)]
        wanted = [self._future(i) for i in range(start, start + n)]
        # earlier look-ahead nobody asked for (another rank's prompts): dropped
        for i in [i for i in self.queued if i < start]:
            self.queued.pop(i).cancel()
        for i in range(start, start + n):
            self.queued.pop(i, None)
        for i in range(start + n, start + n + self.ahead):
            self._future(i)
        return [f.result() for f in wanted]

    def _future(self, index: int) -> Future:
        if index not in self.queued:
            self.queued[index] = self.pool.submit(self.make, index)
        return self.queued[index]

    def close(self) -> None:
        """Drop the queued look-ahead and stop the thread (does not wait for a prompt being
        prepared)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.queued.clear()
