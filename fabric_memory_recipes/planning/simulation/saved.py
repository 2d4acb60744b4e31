"""The simulated step's saved-tensor hooks (planning/simulation/simulate.py): what autograd saves for backward,
counted, and with activation offload moved to host memory as training/techniques/offload.py does."""

from __future__ import annotations

from typing import Any

import torch

from fabric_memory_recipes.planning.plan import Plan
from fabric_memory_recipes.planning.simulation.tracking import SavedTensorCounter, Tracker


class SimulatedSaves(SavedTensorCounter):
    """The simulation's saved-tensor hooks: count every saved storage (as a real run's counter would),
    mark it as an activation, and with ``activation_offload`` move it to host memory as
    fabric_memory_recipes.training.techniques.offload.offload_activations does: the device copy is no longer referenced by the graph (it
    is freed when the forward pass drops it) and backward copies it back just before it is needed.
    ``largest_offloadable``: the largest tensor offload copies, or would copy without it (same saves)."""

    def __init__(self, exclude: list[torch.Tensor], tracker: Tracker, plan: Plan) -> None:
        super().__init__(exclude)
        self.tracker = tracker
        self.offload = plan.activation_offload
        self.min_bytes = plan.offload_min_bytes
        self.largest_offloadable = 0

    def _pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        if id(st) in self._exclude:
            return t
        nbytes = t.numel() * t.element_size()
        if nbytes >= self.min_bytes:
            self.largest_offloadable = max(self.largest_offloadable, nbytes)
        if self.offload and nbytes >= self.min_bytes:
            with self.tracker.creating("host"):  # counts 0 on the device
                host = torch.empty_like(t)  # one host copy per saved tensor, its layout kept, as offload.py
            self._seen[host.untyped_storage()] = host.untyped_storage().nbytes()
            return ("offloaded", host)
        super()._pack(t)
        self.tracker.retag(t, "activations", only_from=("temporaries",))
        return t

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and packed and packed[0] == "offloaded":
            return packed[1].clone()  # back on the device: a temporary of the backward pass
        return packed
