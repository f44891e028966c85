"""Flat state buffers: the delayed-scaling states of one pass (forward or backward) under one registry key, laid out
as column ranges of one history `[L, capacity]`, one scale `[capacity]` and one counter `[states]` tensor.

A state registered eagerly is placed into its key's block (its tensors become views of the block's columns), so that
the batched update at autocast exit (and after the last backward) is a few whole-buffer operations whatever the
number of modules: no per-state slicing, concatenation or copying back (SPEC section 6). The update runs in place
(`state.update_in_place`) on views and buffers the block makes once per layout, among them a work buffer of the
history's size (the rolled copy the torch update needs): in steady state it allocates nothing at exit. States
registered while torch.compile traces or a graph is captured stay on their own tensors (`ScalingState` as before)
and take the general path of `state.update_states`; a block a captured graph uses is pinned: it never moves its
tensors again.

A state leaves its block (keeping its values in tensors of its own) when its tensors are replaced: `.to()` onto
another device, a history of another shape, a copy.

Recompute records (`fp8kit.pytorch.recompute`) need the forward scales of the step they repeat after the update
changed them: a block hands out one `BlockScales` per period between updates, and the update saves the scales
(one copy of the whole scale buffer) before changing them, only when a record asked, into the buffer of a period
whose records are all gone (reused only when no view or other reference to it is left), else into a new one.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Sequence

import numpy as np
import torch

from . import cpu_kernels, host, kernels
from .cpu_kernels.pool import references, unshared
from .state import ScalingState, UpdateBuffers, advance_counters, update_in_place
from .state import update_states as update_each

__all__ = ["SlotBlock", "BlockScales", "place", "update_states", "whole_block", "can_update_whole"]

_FIRST_COLUMNS = 48  # columns of a new block (16 Linear forward states); doubled as needed


class BlockScales:
    """The scales of a block's states as they are now, also after later updates (for recompute records)."""

    __slots__ = ("block", "saved")

    def __init__(self, block: "SlotBlock"):
        self.block, self.saved = block, None

    def of(self, state_offset: int) -> "StateScales":
        return StateScales(self, state_offset)

    def __del__(self):
        # the last record of this period is gone: the block may copy a later period's scales into the same buffer
        saved = self.saved
        if saved is not None:
            self.saved = None
            probe = object()  # a local as `saved` is: what one name of this frame shows now (pool.references)
            try:
                # kept only if nothing else refers to it: no other Python reference, no view (a recompute's
                # quantizer holds one while it runs)
                if references(saved) <= references(probe) and unshared(saved):
                    self.block.spare_snapshot(saved)
            except Exception:  # interpreter shutdown (module globals gone): nothing to keep
                pass


class StateScales:
    """One state's scales of a `BlockScales`: `scales[i]` is the 0-d scale of slot i."""

    __slots__ = ("owner", "offset")

    def __init__(self, owner: BlockScales, offset: int):
        self.owner, self.offset = owner, offset

    def __getitem__(self, slot: int) -> torch.Tensor:
        owner = self.owner
        values = owner.saved if owner.saved is not None else owner.block.scale
        return values[self.offset + slot]


class SlotBlock:
    """See the module docstring. `members[i]` is (weakref to the state, first column, columns) of counter i."""

    def __init__(self, length: int, device: torch.device):
        self.length, self.device = length, device
        self.history = self.scale = self.count = None
        self.columns = 0
        self.members: List[tuple] = []
        self.attached = 0  # live states whose tensors view this block
        self.version = 0  # bumped when a state joins or leaves
        self.pinned = False  # a captured graph holds the tensors' addresses
        self._owners: Optional[torch.Tensor] = None
        self._numpy = None
        self._work: Optional[tuple] = None  # (UpdateBuffers, counters, owners) of the used columns, made once
        self._scales: Optional[BlockScales] = None
        self._spare: List[torch.Tensor] = []  # snapshot buffers no record refers to any more (see `freeze_snapshot`)
        self._left: set = set()  # member indices whose state left the block
        self._allocate(_FIRST_COLUMNS, 16)

    def _allocate(self, columns: int, states: int) -> None:
        old = (self.history, self.scale, self.count)
        if old[0] is not None:
            self.freeze_snapshot()
        with torch.inference_mode(False), torch.no_grad():
            self.history = torch.zeros(self.length, columns, dtype=torch.float32, device=self.device)
            self.scale = torch.ones(columns, dtype=torch.float32, device=self.device)
            self.count = torch.zeros(states, dtype=torch.int64, device=self.device)
            if old[0] is not None:
                used = self.columns
                self.history[:, :used].copy_(old[0][:, :used])
                self.scale[:used].copy_(old[1][:used])
                self.count[:len(self.members)].copy_(old[2][:len(self.members)])
        self._numpy = self._work = None
        for index, (ref, start, n) in enumerate(self.members):
            state = ref()
            if state is not None and state._block is self:
                self._point(state, index, start, n)

    def _compact(self) -> None:
        """Drop the columns of states that died or left (kept until now: nothing else moves the live ones), in one
        gather per tensor; the live states' tensors become views of the new buffers."""
        live = []
        for index, (ref, start, n) in enumerate(self.members):
            state = ref()
            if index not in self._left and state is not None and state._block is self:
                live.append((state, index, start, n))
        self.freeze_snapshot()
        columns = [c for _, _, start, n in live for c in range(start, start + n)]
        with torch.inference_mode(False), torch.no_grad():
            cols = torch.tensor(columns, dtype=torch.int64, device=self.device)
            rows = torch.tensor([index for _, index, _, _ in live], dtype=torch.int64, device=self.device)
            history, scale, count = self.history[:, cols], self.scale[cols], self.count[rows]
        self.members, self._left, self.columns, self._owners = [], set(), 0, None
        self.history = self.scale = self.count = None
        self._allocate(max(_FIRST_COLUMNS, 2 * len(columns)), max(16, 2 * len(live)))
        with torch.inference_mode(False), torch.no_grad():
            self.history[:, :len(columns)].copy_(history)
            self.scale[:len(columns)].copy_(scale)
            self.count[:len(live)].copy_(count)
        for state, _, _, n in live:
            self._point(state, len(self.members), self.columns, n)
            self.members.append((weakref.ref(state, self._died), self.columns, n))
            self.columns += n
        self.attached = len(live)

    def _dead_columns(self) -> int:
        return sum(self.members[i][2] for i in self._left)

    def _point(self, state: ScalingState, index: int, start: int, n: int) -> None:
        state._buffer, state._len = self.history[:, start:start + n], self.length
        state._scale, state._count = self.scale[start:start + n], self.count[index]
        state._views = state._slot_views = None
        state._block, state._start = self, start

    def place(self, state: ScalingState) -> bool:
        """Move `state`'s values into new columns of the block and make its tensors views of them (False when the
        block cannot take it: another device or history length, or pinned and full)."""
        n = state.num_slots
        if state._block is not None or state.history_len != self.length or state.scale.device != self.device:
            return False
        full = self.columns + n > self.scale.shape[0] or len(self.members) >= self.count.shape[0]
        if full:
            if self.pinned:
                return False
            if 2 * self._dead_columns() >= self.columns:
                self._compact()
            if self.columns + n > self.scale.shape[0] or len(self.members) >= self.count.shape[0]:
                self._allocate(max(2 * self.scale.shape[0], self.columns + n), 2 * self.count.shape[0])
        start, index = self.columns, len(self.members)
        with torch.inference_mode(False), torch.no_grad():
            self.history[:, start:start + n].copy_(state.amax_history)
            self.scale[start:start + n].copy_(state.scale)
            self.count[index].copy_(state.count.reshape(()))
        self.columns += n
        self.version += 1
        self.members.append((weakref.ref(state, self._died), start, n))
        self.attached += 1
        self._owners = None
        self._numpy = self._work = None
        self._point(state, index, start, n)
        return True

    def _died(self, ref) -> None:
        for index, (r, _, _) in enumerate(self.members):
            if r is ref:
                if index not in self._left:
                    self._left.add(index)
                    self.attached -= 1
                    self.version += 1
                return

    def detach(self, state: ScalingState) -> None:
        """`state` leaves the block with copies of its values (its columns are not used again)."""
        if state._block is not self:
            return
        with torch.inference_mode(False), torch.no_grad():
            state._buffer, state._scale, state._count = state._buffer.clone(), state._scale.clone(), \
                state._count.clone()
        state._views = state._slot_views = None
        state._block = None
        for index, (ref, _, _) in enumerate(self.members):
            if ref() is state and index not in self._left:
                self._left.add(index)
                self.attached -= 1
                self.version += 1

    # ---- recompute records ----

    def scales_now(self) -> BlockScales:
        """The scales as they are now, for as long as a record needs them (see the module docstring)."""
        found = self._scales
        if found is None:
            found = self._scales = BlockScales(self)
        return found

    def freeze_snapshot(self) -> None:
        """Before the scales change in place: records made since the last update keep the current values, copied
        into a buffer an earlier period's records left (their `BlockScales` gone), so that a steady-state update
        allocates nothing (an allocation right after a forward pass pays the C allocator's deferred work on the
        forward's freed temporaries: about 1 ms after 1,000 modules, docs/performance.md), else into a new one."""
        found = self._scales
        if found is not None:
            work = self._work
            scale = work[0].scale if work is not None else self.scale[:self.columns]
            saved = None
            while saved is None:
                try:
                    buffer = self._spare.pop()  # (a BlockScales dying on another thread may append meanwhile)
                except IndexError:
                    break
                if buffer.shape == scale.shape and buffer.device == scale.device \
                        and buffer.is_inference() == torch.is_inference_mode_enabled():
                    saved = buffer.copy_(scale)
            found.saved = saved if saved is not None else scale.clone()
            self._scales = None

    def spare_snapshot(self, buffer: torch.Tensor) -> None:
        """Keep the snapshot buffer of a `BlockScales` that died, which has checked that nothing else refers to it.
        At most two."""
        if len(self._spare) < 2:
            self._spare.append(buffer)

    # ---- the update ----

    def owners(self) -> torch.Tensor:
        """int64 `[columns]`: the counter index of each used column."""
        if self._owners is None:
            with torch.inference_mode(False):
                self._owners = torch.tensor([i for i, (_, _, n) in enumerate(self.members) for _ in range(n)],
                                            dtype=torch.int64, device=self.device)
        return self._owners

    def update(self, recipe, fp8_max: float) -> None:
        """The batched update of every column (recipes without callables); unused columns stay unchanged."""
        if self._left and not self.pinned and self._dead_columns() > self.columns // 2:
            self._compact()  # most columns belong to states that are gone: stop updating them
        self.freeze_snapshot()
        if host.active(self.device):
            self._update_host(recipe, fp8_max)
            return
        work = self._work
        if work is None:
            work = self._work = self._views()
        buffers, counts, owners = work
        buffers.mark_used()
        recompute = advance_counters(counts, owners, buffers, recipe.interval)
        if recipe.interval == 1 and kernels.on_for(self.device):
            # one launch over the whole buffer: unused columns hold 0 staging values, which the rule leaves alone
            kernels.update_tensors([self.history], [self.scale], recipe, fp8_max)
            return
        if buffers.work is None:
            with torch.inference_mode(False):
                buffers.make_work()
        update_in_place(buffers, recipe, fp8_max, recompute)

    def _views(self) -> tuple:
        """(UpdateBuffers of the used columns, counters of the members, owners), made once per layout."""
        columns, states = self.columns, len(self.members)
        with torch.inference_mode(False):
            history = self.history if columns == self.scale.shape[0] else self.history[:, :columns]
            scale = self.scale if columns == self.scale.shape[0] else self.scale[:columns]
            counts = self.count if states == self.count.shape[0] else self.count[:states]
            return UpdateBuffers(history, scale), counts, self.owners()

    def _update_host(self, recipe, fp8_max: float) -> None:
        views = self._numpy
        if views is None:
            columns, states = self.columns, len(self.members)
            owners = np.repeat(np.arange(states), [n for _, _, n in self.members])
            views = self._numpy = (self.history[:, :columns].numpy(), self.scale[:columns].numpy(),
                                   self.count[:states].numpy(), owners)
        history, scale, counts, owners = views
        mask = None
        if recipe.interval > 1:
            mask = (counts % recipe.interval == 0)[owners]
        takes_part = np.bincount(owners, weights=history[0] != 0, minlength=counts.shape[0]) > 0
        if not (cpu_kernels.available() and cpu_kernels.delayed_update(
                history, scale, mask, recipe.amax_compute_algo == "most_recent", recipe.scaled_max(fp8_max),
                host.SCALE_MIN, host.FLT_MAX, recipe.power_2_scale)):
            new_history, new_scale = host.compute_update(history, scale, recipe, fp8_max, mask)
            history[...] = new_history
            scale[...] = new_scale
        counts += takes_part


def can_update_whole(block: SlotBlock, recipe) -> bool:
    """Whether `block.update` applies (else the general path of `state.update_states`). With the Triton kernels on,
    a whole block is still updated by its few torch operations (the update kernel takes contiguous histories)."""
    return not recipe.uses_callables and not torch.compiler.is_compiling()


def whole_block(states: Sequence[ScalingState]) -> Optional[SlotBlock]:
    """The block whose attached states are exactly `states` (distinct), or None."""
    if not states:
        return None
    block = states[0]._block
    if block is None or len(states) != block.attached:
        return None
    for s in states:
        if s._block is not block:
            return None
    return block


def update_states(states: List[ScalingState], recipe, fp8_max: float) -> None:
    """`state.update_states`, as whole-buffer operations when `states` are the attached states of one block."""
    block = whole_block(states)
    if block is not None and can_update_whole(block, recipe):
        block.update(recipe, fp8_max)
        return
    if not torch.compiler.is_compiling():
        for block in {id(s._block): s._block for s in states if s._block is not None}.values():
            block.freeze_snapshot()  # the scales of some of its states change in place
    update_each(states, recipe, fp8_max)


def place(blocks: dict, which: str, state: ScalingState) -> None:
    """Place `state` into the block of pass `which` in `blocks` (created as needed)."""
    block = blocks.get(which)
    if block is None or block.length != state.history_len or block.device != state.scale.device:
        if block is not None and block.attached > 0:
            return  # the key's states live elsewhere: keep this one on its own tensors
        block = blocks[which] = SlotBlock(state.history_len, state.scale.device)
    block.place(state)
