"""One decode step of a whole model (every layer and the LM head) captured as a CUDA graph and
replayed on a static `SubquadraticCache`.

A static cache gives a one-token step fixed shapes, stable addresses and no host synchronisation
(positions, slot and counts live on the device and are updated in place), so the step can be
recorded once and replayed: the host then issues one launch per token instead of one per kernel.
`SubquadraticForCausalLM.forward` routes a call here (`replays_decode`) when the cache is static,
on CUDA, built with `cuda_graph=True`, already holds tokens, and the call is a plain one-token step
without gradients (no embeddings, labels, hidden states or attention weights asked for). Anything
else, and every call on CPU, runs eagerly.

The first such step runs eagerly on a side stream (a real step: it compiles every kernel it needs), then
the next one is recorded (unless that step filled the cache: then nothing is recorded); recording runs
no kernel, so the Python-side counts it advanced are put back. Each replay then advances them by what
the recorded step did. `position_ids` and the attention mask of a replayed step are not read: the new
token is taken as real (generate() feeds real tokens, padding only on the left of the prompt), at the
position the cache counts. A capture that fails raises, except on the cache generate() builds by default
(`eager_fallback`): there the warm-up step's logits are returned and the later steps run eagerly.
"""

from __future__ import annotations

import warnings

import torch

from .fused import captured_step


class DecodeGraph:
    """The captured one-token step of `model` on `cache`: the input ids [B, 1] are copied into a
    fixed buffer, the graph replayed, and the logits [B, 1, V] it wrote returned (as a copy)."""

    def __init__(self, model, cache, input_ids: torch.Tensor) -> None:
        self.model, self.cache = model, cache
        self.ids = input_ids.clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.advance: list[int] = []
        self.addresses: list[int] = []
        #: the cache was rewound since the last step (`SubquadraticCache.rewind`): check the addresses
        self.stale = False

    def _addresses(self) -> list[int]:
        state = [*self.cache.allocations(), *self.model.parameters(), *self.model.buffers()]
        return [len(self.cache.layers)] + [-1 if t is None else t.data_ptr() for t in state]

    def still_valid(self) -> bool:
        """Whether every state tensor, parameter and buffer of the model is where the graph was recorded
        (batch surgery that changes the batch size reallocates the states; moving or casting the model
        its weights)."""
        return self.graph is None or self._addresses() == self.addresses

    def __call__(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        if model is not self.model:
            raise ValueError("this static cache's decode step was captured for another model; use a new cache")
        if input_ids.shape != self.ids.shape:
            raise ValueError(f"a captured decode step takes input ids of shape {tuple(self.ids.shape)}, "
                             f"got {tuple(input_ids.shape)}")
        self.ids.copy_(input_ids)
        if self.graph is None:
            return self._warm_up_and_capture()
        self.graph.replay()
        self.cache.set_host_counters([n + d for n, d in zip(self.cache.host_counters(), self.advance, strict=True)])
        return self.logits.clone()

    def _warm_up_and_capture(self) -> torch.Tensor:
        # the plans of a captured step: recorded, the elementwise chains compiled (fused.py) where asked
        settings = captured_step(self.cache.fuse)
        side = torch.cuda.Stream(device=self.ids.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a real step, eagerly: compiles the kernels, initialises cuBLAS
            logits = self.model.decode_logits(self.ids, self.cache, settings)
        torch.cuda.current_stream().wait_stream(side)
        logits.record_stream(torch.cuda.current_stream())
        if not self.cache.has_room(self.ids.shape[1]):
            return logits  # the cache is full: no step follows to replay (another call raises the cache's error)
        before = self.cache.host_counters()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):  # recorded, not run
                self.logits = self.model.decode_logits(self.ids, self.cache, settings)
        except RuntimeError as e:
            self.cache.set_host_counters(before)
            if self.cache.eager_fallback:  # generate()'s default cache: keep decoding, eagerly
                warnings.warn(f"the decode step of this model could not be captured as a CUDA graph ({e}); "
                              "generate() continues with eager steps", stacklevel=3)
                self.cache.cuda_graph, self.cache.decode_graph = False, None
                return logits
            raise RuntimeError(
                f"the decode step of this model could not be captured as a CUDA graph ({e}); build the static "
                "cache with cuda_graph=False (generate(..., disable_compile=True))") from e
        after = self.cache.host_counters()
        self.cache.set_host_counters(before)
        self.advance = [a - b for a, b in zip(after, before, strict=True)]
        self.graph, self.addresses = graph, self._addresses()
        return logits


def replays_decode(cache, input_ids, inputs_embeds, labels, logits_to_keep, wants_extra_outputs: bool) -> bool:
    """Whether a causal-LM call is a step `decode_step` serves (see the module docstring)."""
    return (
        getattr(cache, "static", None) is not None and cache.cuda_graph and cache.seen is not None
        and cache.seen.is_cuda and input_ids is not None and input_ids.shape[1] == 1 and inputs_embeds is None
        and labels is None and not wants_extra_outputs and not torch.is_grad_enabled()
        and isinstance(logits_to_keep, int) and logits_to_keep in (0, 1)
    )


def decode_step(model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, 1, V] of one real token per row, through the cache's captured step (captured at the
    first call)."""
    graph = cache.decode_graph
    if graph is not None and graph.stale:  # a rewound cache: the step replays where nothing moved
        graph.stale = False
        if graph.model is not model or graph.ids.shape != input_ids.shape or not graph.still_valid():
            cache.decode_graph = None
    if cache.decode_graph is None:
        cache.decode_graph = DecodeGraph(model, cache, input_ids)
    return cache.decode_graph(model, input_ids)
