"""Requests kept out of upstream's loops for a step, where upstream cannot tell.

A parked request in ``running`` would only be refused: one hook call and one
pass of upstream's loop body apiece, every step it stays parked. Taken out of
``running`` for the step, it costs O(1), and upstream does what it would have
done with it refused, provided that:

- no preemption can happen (``kv_room_for``): upstream's victim is then
  ``running``'s tail, or the biased parked request under PRIORITY;
- upstream does not count LoRA adapters over ``running``;
- they keep their slots: the active cap drops by their number (only without
  ``max_num_active_seqs`` below ``max_num_seqs``, whose accounting
  ``request_hooks`` keeps);
- no per-request budget split counts them (``long_prefill_token_threshold``
  relaxes for a lone request);
- a waiting request still sees running ones when any hold the KV cache
  (upstream applies its watermark only then).

Invariant: whatever is taken out goes back in its place (``put_back``), and the
requests hidden are counted as passed over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.upstream import RUNNING, Upstream

if TYPE_CHECKING:
    from engine_ext.scheduling.upstream import Request


class Hiding:
    """When and how requests may be left out of ``running`` for a step."""

    __slots__ = ("allowed", "kv_block_sizes", "upstream")

    def __init__(self, upstream: Upstream, kv_block_sizes: tuple[int, ...] | None):
        self.upstream = upstream
        #: Block size of each KV cache group when every group is full attention
        #: (one block per ``block_size`` tokens a request grows): what
        #: ``kv_room_for`` bounds; None otherwise.
        self.kv_block_sizes = kv_block_sizes
        #: Whether the settings let a step take requests out of ``running``
        #: unnoticed by upstream: no active cap below the slots, no long-prefill
        #: threshold (upstream's ``get_request_counts()`` reads ``running``), no
        #: LoRA (vLLM 0.33 counts the adapters of all of ``running`` against
        #: ``max_loras`` before admitting).
        self.allowed = not (
            upstream.max_active < upstream.slots
            or upstream.long_prefill_threshold
            or upstream.lora
        )

    def hide_parked(self, step: PacedStep) -> list[Request]:
        """Takes the parked requests (the tail of ``running``, after slot
        yielding) out of ``running`` and returns them, passed over for lack of
        budget; [] when upstream must see them."""
        if not self.allowed:
            return []
        upstream = self.upstream
        running = upstream.running
        remaining = [r for r in step.parked if r.status == RUNNING]
        visible = len(running) - len(remaining)
        if not remaining or running[visible] is not remaining[0]:
            return []
        if not visible and upstream.anything_waits():
            return []
        if not self.kv_room_for(visible):
            return []
        del running[visible:]
        upstream.set_active_cap(upstream.max_active - len(remaining))
        user = step.book.user
        for request in remaining:
            name = user(request.request_id)
            step.refused.add(name)
            step.passed_over(request, name)
        return remaining

    def kv_room_for(self, requests: int) -> bool:
        """Whether the KV cache has free blocks for the most that ``requests``
        running requests can claim in one step, so that upstream's running loop
        cannot preempt: each needs at most its new and lookahead tokens' worth
        of blocks plus one, the step's tokens are at most its token budget."""
        if self.kv_block_sizes is None:
            return False  # a cache kind whose growth this bound does not cover
        upstream = self.upstream
        tokens = upstream.token_budget + requests * upstream.lookahead_tokens
        needed = sum(tokens // size + 2 * requests for size in self.kv_block_sizes)
        return upstream.free_kv_blocks() >= needed


def put_back(
    running: list[Request], original: list[Request], shown: list[Request]
) -> None:
    """Restores ``running`` after a step that showed upstream only ``shown`` of
    ``original``: ``original``'s order for the requests hidden or still there,
    then any the step admitted. (Steps that hide requests admit and preempt
    nothing; this keeps every request right even if one did, or raised midway.)"""
    if running == shown:  # the usual case: nothing came or went
        running[:] = original
        return
    present = {id(request) for request in running}
    visible = {id(request) for request in shown}
    known = {id(request) for request in original}
    running[:] = [
        *(r for r in original if id(r) in present or id(r) not in visible),
        *(r for r in running if id(r) not in known),
    ]
