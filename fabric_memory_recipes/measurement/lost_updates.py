"""Lost updates of bf16 weights, counted at sampled optimizer steps (``--lost-updates N``).

Why an update is lost, and the fixes (``--bf16-update``): fabric_memory_recipes/training/techniques/bf16.py,
whose :func:`~fabric_memory_recipes.training.techniques.bf16.updates` attaches this probe to a rung's optimizer.

What the measurement counts. Every ``N``-th optimizer step, hooks on the optimizer copy
the weights before the step and compare after it. A parameter *should* change when its gradient is not
zero and an update of the size the optimizer intends would move it in fp32 (plain SGD: ``lr * grad``
exactly; Adam-like: about ``lr``), so that a learning rate decayed to ~0 does not count. It *did* change
when its effective value moved: the stored weight, plus the Kahan buffer for ``kahan``. Recorded per
sampled step: ``lost`` = should and did not / should, and ``unchanged`` = stored bf16 weights that did not
move / all (what a plain comparison of the weights shows). Stochastic rounding leaves many weights
unchanged in a step by design (each moves with a probability): its ``lost`` stays high and its effect
shows in the loss curve instead. The copy costs one set of weights while a sampled step runs, and a
synchronisation: leave the flag off for memory and speed runs.
"""

from __future__ import annotations

from typing import Any

import torch


class LostUpdates:
    """Counts lost updates at sampled steps through optimizer step hooks (what it counts: the module docstring).

    Several optimizers may report into one probe (rungs 12 and 14: one optimizer per parameter, stepped
    inside backward); the loop's step counter (``results.optimizer_steps``, increased after each step)
    tells which step a hook belongs to, so their counts add up per step.
    """

    def __init__(self, results, every: int) -> None:
        self.results, self.every = results, every
        self.record: dict[str, Any] = {"every": every, "steps": []}
        self._current: list | None = None  # [step, lost, should, unchanged, total] being summed
        self._before: dict[int, tuple] = {}

    def _sampled(self, step: int) -> bool:
        return step % self.every == 0

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    @staticmethod
    def _kahan(optimizer, p) -> torch.Tensor | None:
        """torch-optimi's compensation buffer of ``p`` (what rounding dropped so far), if it has one."""
        comp = optimizer.state[p].get("kahan_comp") if p in optimizer.state else None
        return comp if isinstance(comp, torch.Tensor) and comp.shape == p.shape else None

    @torch.no_grad()
    def _pre(self, optimizer, args, kwargs) -> None:
        step = self.results.optimizer_steps + 1
        if not self._sampled(step):
            return
        sgd = type(optimizer).__name__ in ("SGD", "StochasticRoundSGD")  # update = lr * grad exactly
        for group in optimizer.param_groups:
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                comp = self._kahan(optimizer, p)
                self._before[id(p)] = (
                    p.detach().clone(),
                    self._should_change(p, lr, sgd),  # now: some optimizers reuse .grad as a buffer
                    None if comp is None else comp.detach().clone(),
                )

    @staticmethod
    def _should_change(p: torch.Tensor, lr: float, sgd: bool) -> torch.Tensor:
        """Parameters whose update would move them in fp32: a non-zero gradient, and an update of the
        size the optimizer intends (SGD: ``lr * grad``; Adam-like: about ``lr``) that fp32 does not
        round away. The second part keeps a learning rate decayed to ~0 (cosine) from counting as loss."""
        g = p.grad.detach().float()
        w = p.detach().float()
        update = g * lr if sgd else torch.sign(g) * lr
        return (g != 0) & ((w - update) != w)

    @torch.no_grad()
    def _post(self, optimizer, args, kwargs) -> None:
        step = self.results.optimizer_steps + 1
        if not self._before:
            return
        counts = torch.zeros(4, dtype=torch.int64, device=next(iter(self._before.values()))[0].device)
        for group in optimizer.param_groups:
            for p in group["params"]:
                saved = self._before.pop(id(p), None)
                if saved is None:
                    continue
                old, should, old_comp = saved
                stored_same = p.detach() == old
                same = stored_same
                comp = self._kahan(optimizer, p)
                if comp is not None:  # the effective weight is the stored one plus the compensation
                    before = old.float() + (old_comp.float() if old_comp is not None else 0.0)
                    same = (p.detach().float() + comp.float()) == before
                counts += torch.stack(
                    [
                        (should & same).sum(),
                        should.sum(),
                        stored_same.sum(),
                        torch.tensor(p.numel(), device=counts.device),
                    ]
                ).to(counts.device)
        self._before.clear()
        lost, should, unchanged, total = (int(v) for v in counts.tolist())
        if self._current is not None and self._current[0] == step:  # one optimizer per parameter
            for i, v in enumerate((lost, should, unchanged, total), start=1):
                self._current[i] += v
        else:
            self._current = [step, lost, should, unchanged, total]
            self.record["steps"].append(self._current)
        self._summarise()

    def _summarise(self) -> None:
        """Keep ``record`` in its JSON form: rows [step, lost, unchanged] and their means."""
        rows = [
            [s, lost / should if should else 0.0, unchanged / total if total else 0.0]
            for s, lost, should, unchanged, total in self.record["steps"]
        ]
        self.results.updates["lost"] = {
            "every": self.every,
            "columns": ["step", "lost", "unchanged"],
            "steps": rows,
            "mean_lost": sum(r[1] for r in rows) / len(rows),
            "mean_unchanged": sum(r[2] for r in rows) / len(rows),
            "last_lost": rows[-1][1],
        }
