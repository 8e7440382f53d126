"""LoRASlots: which adapter each of the runner's `max_loras` slots holds, and who uses it.

A running request holds its adapter's slot (`acquire` at admission, `release` when it
ends or is preempted), so a slot in use is never reloaded under it. An adapter not in a
slot is loaded on demand into a free slot, else into the least recently used one no
running request holds; when every slot is held, the request waits (`acquire` gives
None). So a step never has more distinct adapters than slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from gristmill.errors import LoRAAdapterError
from gristmill.lora import LoRARequest


class LoRASlots:
    """Check-then-change in one call: `acquire` changes nothing when it gives None or
    when loading fails (LoRAAdapterError; the slot keeps the adapter it held)."""

    def __init__(self, num_slots: int, load: Callable[[int, LoRARequest], None]):
        """`load(slot, lora)`: puts the adapter's weights in the slot (the model runner's
        `load_lora`); raises LoRAAdapterError, the slot unchanged, when it cannot run."""
        self.num_slots = num_slots
        self._load = load
        self.adapters: list[LoRARequest | None] = [None] * num_slots
        #: Running requests holding each slot.
        self.users = [0] * num_slots
        self._slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self._recent: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(num_slots))  # LRU first
        #: Adapters loaded since the engine started (a reload after an eviction counts).
        self.num_loads = 0

    def acquire(self, lora: LoRARequest) -> int | None:
        """The slot holding `lora`, loaded now if it is in none, held once more; None when
        it is in no slot and every slot is held."""
        slot = self._slot_of.get(lora.lora_int_id)
        if slot is not None and not lora.same_adapter(self.adapters[slot]):
            held = self.adapters[slot]
            raise LoRAAdapterError(f"lora_int_id {lora.lora_int_id} names adapter {held.lora_name!r} "
                                   f"({held.lora_path}) in this engine, not {lora.lora_name!r} ({lora.lora_path}); "
                                   f"give each adapter its own lora_int_id", lora_name=lora.lora_name)
        if slot is None:
            idle = [s for s in self._recent if self.users[s] == 0]  # least recently used first
            if not idle:
                return None
            slot = next((s for s in idle if self.adapters[s] is None), idle[0])  # an empty one first
            self._load(slot, lora)  # (raises LoRAAdapterError: the slot holds what it held)
            old = self.adapters[slot]
            if old is not None:
                del self._slot_of[old.lora_int_id]
            self.num_loads += 1
            self.adapters[slot] = lora
            self._slot_of[lora.lora_int_id] = slot
        self.users[slot] += 1
        self._recent.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        if self.users[slot] < 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")

    @property
    def loaded(self) -> list[str]:
        """Names of the adapters in slots, least recently used first."""
        return [self.adapters[s].lora_name for s in self._recent if self.adapters[s] is not None]
