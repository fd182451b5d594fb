"""Continuous batching: mlx-lm's BatchGenerator, each of its steps one pass of the model's forward (forward.py).

mlx-lm's BatchGenerator steps the sequences being generated (one pass), then prompt chunks (another pass), and a
prompt's last token in a pass of its own when it joins the generation batch. When weights stream from flash each
pass reads them, so here a step is one pass (`FlashBatchGenerator`): the generating sequences' next tokens, the last
tokens of prompts that join them, and as many prompt tokens as the pass's positions leave room for (chunked
prefill). mlx-lm's batches then run as before: the decode step's model call computes the rest beside it, and the
prompts' calls find theirs done (`BatchModel`). A prompt segment's end is a pass's end, so the server's prompt cache
stores what the segment holds, as with mlx-lm's schedule.
"""

import time
from typing import Dict

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

from ..io.memory import give_back
from .forward import SequenceBatch

STATS_KEPT = 1024  # per-pass stats kept while batching (/metrics counts the device bytes)


class BatchModel:
    """The flash model as mlx-lm's BatchGenerator calls it: a batch of per-sequence caches (SequenceBatch) goes
    through the forward's batched pass (the units read once for all its sequences, each sequence's tokens
    what it alone would get), with the sequences `beside` it in the same pass, unless its sequences were computed
    already (`done`); the rest is the model itself."""

    def __init__(self, model):
        self.model = model
        self.batch_size = self.largest_batch = 0  # sequences in the last decode pass, and the most in one
        self.beside = []  # (token ids, caches, logits wanted) the next pass computes too (FlashBatchGenerator)
        self.done: Dict[int, np.ndarray] = {}  # id(first layer's cache) -> its logits (None: a prompt chunk)

    def __call__(self, inputs, cache=None, **kwargs):
        if not (cache and isinstance(cache[0], SequenceBatch)):
            return self.model(inputs, cache=cache, **kwargs)
        done = self._done(inputs, cache)
        if done is not None:
            return done
        if inputs.shape[1] == 1:
            self._count(inputs.shape[0] + sum(wanted for *_, wanted in self.beside))
        return self.model.forward.batch(inputs, cache, self.run)

    def run(self, seqs, prompt: bool = False) -> np.ndarray:
        """forward.run of `seqs` and the sequences beside them (their logits kept in `done`): seqs' logits."""
        beside, self.beside = self.beside, []
        stats = self.model.flash.stats
        if len(stats.tokens) >= STATS_KEPT:  # a server runs for long: the device bytes are the readers' counters
            stats.reset()
        prompt = prompt or not all(w for *_, w in beside)
        logits = self.model.forward.run(seqs + [(ids, caches) for ids, caches, _ in beside], prompt)
        if prompt:
            give_back()  # (what a prompt pass's buffers left in MLX's cache and glibc's arenas, as generate does)
        for (_, caches, wanted), row in zip(beside, logits[len(seqs) :]):
            self.done[id(caches[0])] = row if wanted else None
        return logits[: len(seqs)]

    def _count(self, n: int):
        self.batch_size = n
        self.largest_batch = max(self.largest_batch, n)

    def _done(self, inputs, cache):
        """The logits of a pass whose sequences were computed already beside another (the caches then only count
        its tokens), or None."""
        n = inputs.shape[1]
        live = [c for c, m in zip(cache[0].caches, cache[0].lengths(n)) if m]
        if not live or any(id(c) not in self.done for c in live):
            return None
        for c in cache:
            c.advance(n)
        rows = [self.done.pop(id(c)) for c in live]
        if any(r is None for r in rows):
            return mx.zeros((inputs.shape[0], 1, 1))  # a prompt chunk: nothing reads its logits
        return mx.array(np.stack(rows))[:, None]

    def __getattr__(self, name):
        return getattr(self.model, name)


class FlashBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator whose steps are one pass each (the module's docstring). Each sequence's tokens are
    those of its solo run: a pass computes every sequence at its own position as it alone would be
    (Forward.sequences_alone), its prompt in the chunks of a request alone where a chunk's rows compute together
    (not Forward.rows_alone: MLX's attention over a chunk). Where a sequence's rows would depend on what else a pass
    holds (the native step's MoE router), mlx-lm's schedule, whose prompt chunks are those of a request alone."""

    def _next(self):
        if not (isinstance(self.model, BatchModel) and self.model.forward.sequences_alone):
            return super()._next()  # (its passes: a decode step's rows alone, each prompt chunk alone)
        try:
            return self._step()
        finally:
            self.model.beside, self.model.done = [], {}

    def _step(self):
        gen, prompts, processing = self._generation_batch, self._prompt_batch, self._currently_processing
        n = min(
            self.prefill_batch_size - len(prompts),
            self.completion_batch_size - len(gen) - len(prompts),
            len(self._unprocessed_sequences),
        )
        if n > 0:
            prompts.extend(self._make_batch(n))
        # A prompt's last token is a segment of its own (insert_segments): it joins the generation batch in a pass
        # after the one that ended the segment before it
        joining = [i for i, (segments, *_) in enumerate(processing) if len(segments) == 1 and len(segments[0]) == 1]
        room = self.prefill_step_size - len(gen) - len(joining)
        whole = not self.model.forward.rows_alone  # each chunk as a request alone cuts it
        chunks = []
        for i, (segments, *_) in enumerate(processing):
            take = 0 if i in joining else min(len(segments[0]), self.prefill_step_size) if whole else max(0, room)
            if whole and take > room and any(chunks):  # (a whole chunk waits for a pass with room, but the first)
                take = 0
            chunks.append(segments[0][:take])
            room -= len(chunks[-1])

        # The pass: the decode step's, with the joining tokens and the chunks beside (or theirs alone)
        tic = time.perf_counter()
        for i, (segments, *_) in enumerate(processing):
            if i in joining or chunks[i]:
                for c in prompts.prompt_cache:  # (a sequence handed out to the prompt cache is copied first)
                    c.own([i])
                caches = [c.caches[i] for c in prompts.prompt_cache]
                self.model.beside.append((segments[0] if i in joining else chunks[i], caches, i in joining))
        generation_responses = gen.next() if len(gen) > 0 else []
        if self.model.beside:
            self.model.run([])
        spent = time.perf_counter() - tic  # (mlx-lm's counters: a pass with prompt tokens counts as prompt time)
        if any(chunks):
            self._counters.prompt_time += spent
        else:
            self._counters.decode_time += spent
        if generation_responses:
            self._counters.generation_tokens += len(generation_responses)
            self._counters.generation_steps += 1

        prompt_responses = []
        for i, seq in enumerate(processing):
            if chunks[i]:
                segments = seq[0]
                segments[0] = segments[0][len(chunks[i]) :]
                ended = not segments[0]
                if ended:
                    segments.pop(0)
                seq[1] += len(chunks[i])
                prompt_responses.append(PromptProcessingBatch.Response(prompts.uids[i], (seq[1], seq[2]), ended, False))
        if joining:
            last = [processing[i][0][0] for i in joining]
            for i in joining:
                prompt_responses.append(
                    PromptProcessingBatch.Response(prompts.uids[i], (processing[i][2],) * 2, True, True)
                )
            keep = [i for i in range(len(processing)) if i not in joining]
            self._currently_processing = [processing[i] for i in keep]
            chunks = [chunks[i] for i in keep]
            gen.extend(prompts.split(joining).generate(last))  # (its first pass found done)
        if any(chunks):
            self._counters.prompt_tokens += sum(len(c) for c in chunks)
            prompts.prompt(chunks)  # (found done)
        return prompt_responses, generation_responses
