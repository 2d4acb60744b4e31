"""fabric_memory_recipes.training.techniques.bf16: plain bf16 weights lose small updates, the fixes keep them, and the measurement counts right."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from fabric_memory_recipes.config import RunConfig, UsageError
from fabric_memory_recipes.techniques import BF16_UPDATES
from fabric_memory_recipes.training import cli
from fabric_memory_recipes.training.techniques import bf16

HAVE_OPTIMI = importlib.util.find_spec("optimi") is not None
HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None
STEPS, LR = 100, 1e-3  # 100 updates of -0.001 to weights at 1.0: each is below half a bf16 step (2^-8)


def fix_available(update: str, optimizer: str) -> bool:
    if update == "kahan":
        return HAVE_OPTIMI
    if update == "stochastic" and optimizer == "adam":
        return HAVE_TORCHAO
    return True


def train_ones(optimizer: str, update: str) -> torch.Tensor:
    """4096 bf16 weights at 1.0, gradient 1 for STEPS steps: SGD and Adam both intend -LR per step."""
    torch.manual_seed(0)
    w = torch.ones(4096, dtype=torch.bfloat16, requires_grad=True)
    base = torch.optim.SGD([w], lr=LR) if optimizer == "sgd" else torch.optim.Adam([w], lr=LR)
    opt = bf16.replace(base, update)
    assert (opt is base) == (update == "plain")
    for _ in range(STEPS):
        w.grad = torch.ones_like(w)
        opt.step()
    return w.detach().float()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("update", BF16_UPDATES)
def test_plain_bf16_loses_small_updates_and_the_fixes_keep_them(optimizer, update):
    if not fix_available(update, optimizer):
        pytest.skip(f"--bf16-update {update} needs a package that is not installed")
    w = train_ones(optimizer, update)
    intended = 1.0 - STEPS * LR  # 0.9
    if update == "plain":
        assert torch.all(w == 1.0), "every one of the 100 updates was rounded away"
    elif update == "stochastic":
        assert abs(w.mean().item() - intended) < 0.003, w.mean()  # right on average
        assert w.std().item() > 0, "the rounding is random per element"
    else:  # kahan: the stored weight is within one bf16 step of the intended value
        assert torch.all((w - intended).abs() <= 2**-8), (w.min(), w.max())


def test_round_stochastic_is_unbiased_and_keeps_exact_values():
    torch.manual_seed(0)
    step = 2.0**-7  # the bf16 spacing in [1, 2)
    x = torch.full((200_000,), 1.0 + 0.25 * step)
    r = bf16.round_stochastic(x)
    assert r.dtype == torch.bfloat16
    assert set(r.float().unique().tolist()) == {1.0, 1.0 + step}
    assert (r.float() == 1.0 + step).float().mean().item() == pytest.approx(0.25, abs=0.01)
    assert r.float().mean().item() == pytest.approx(x[0].item(), abs=step * 0.01)
    exact = torch.tensor([0.0, -2.0, 1.5, 2.0**100, float("inf"), float("-inf")])
    assert torch.equal(bf16.round_stochastic(exact).float(), exact)
    assert bf16.round_stochastic(torch.tensor([float("nan")])).isnan().all()
    neg = bf16.round_stochastic(-x).float()  # symmetric: rounds away from zero with the same odds
    assert neg.mean().item() == pytest.approx(-x[0].item(), abs=step * 0.01)


def _log(every: int | None = None):
    return types.SimpleNamespace(optimizer_steps=0, updates={}), RunConfig(lost_updates=every)


def _params():
    """a: an update far below half a step (lost); b: a large one (applied); c: zero gradient (none due)."""
    a, b, c = (torch.ones(n, dtype=torch.bfloat16, requires_grad=True) for n in (300, 100, 50))
    return a, b, c


def _grads(a, b, c):
    a.grad, b.grad, c.grad = torch.full_like(a, 1e-3), torch.full_like(b, 0.25), torch.zeros_like(c)


def test_lost_updates_counts_what_an_update_should_have_changed():
    log, args = _log(every=2)
    a, b, c = _params()
    opt = bf16.updates(torch.optim.SGD([a, b, c], lr=1.0), args, log)
    for _ in range(4):
        _grads(a, b, c)
        opt.step()
        log.optimizer_steps += 1  # what the loop's log.step_done() does after the step
    lost = log.updates["lost"]
    assert lost["every"] == 2 and [row[0] for row in lost["steps"]] == [2, 4], "sampled steps only"
    for _, fraction_lost, unchanged in lost["steps"]:
        assert fraction_lost == pytest.approx(300 / 400)  # a's 300 of the 400 that should move
        assert unchanged == pytest.approx(350 / 450)  # a and c did not move
    assert lost["mean_lost"] == pytest.approx(0.75) and log.updates["rule"] == "plain"
    assert log.updates["optimizer"] == "torch.optim.sgd.SGD"


def test_an_update_that_fp32_would_also_round_away_is_not_counted():
    """A learning rate decayed to zero (the end of a cosine schedule) moves nothing, in any precision."""
    log, args = _log(every=1)
    a, b, c = _params()
    opt = bf16.updates(torch.optim.SGD([a, b, c], lr=0.0), args, log)
    _grads(a, b, c)
    opt.step()
    assert log.updates["lost"]["steps"][0][1:] == [0.0, 1.0]  # nothing due, so nothing lost; none moved


def test_lost_updates_adds_up_one_optimizer_per_parameter():
    """Rungs 12/14 step one optimizer per parameter inside backward: one row per training step."""
    log, args = _log(every=1)
    a, b, c = _params()
    optimizers = bf16.updates({p: torch.optim.SGD([p], lr=1.0) for p in (a, b, c)}, args, log)
    for _ in range(2):
        _grads(a, b, c)
        for o in optimizers.values():
            o.step()
        log.optimizer_steps += 1
    assert [row[0] for row in log.updates["lost"]["steps"]] == [1, 2]
    assert log.updates["lost"]["steps"][1][1:] == pytest.approx([0.75, 350 / 450])


@pytest.mark.skipif(not HAVE_OPTIMI, reason="needs torch-optimi")
def test_lost_updates_counts_the_kahan_buffer_as_applied():
    log, args = _log(every=1)
    args.bf16_update = "kahan"
    a, b, c = _params()
    opt = bf16.updates(torch.optim.SGD([a, b, c], lr=1.0), args, log)
    _grads(a, b, c)
    opt.step()
    log.optimizer_steps += 1
    assert log.updates["rule"] == "kahan" and log.updates["optimizer"].startswith("optimi")
    _, fraction_lost, unchanged = log.updates["lost"]["steps"][0]
    assert fraction_lost == 0.0, "a's update waits in the compensation buffer"
    assert unchanged == pytest.approx(350 / 450), "the stored bf16 weights of a did not move"


def test_unsupported_combinations_are_refused_clearly(tmp_path):
    w, v = (torch.ones(4, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with pytest.raises(UsageError, match="momentum"):
        bf16.replace(torch.optim.SGD([w], lr=0.1, momentum=0.9), "kahan")
    with pytest.raises(UsageError, match="one parameter group"):
        bf16.replace(torch.optim.SGD([{"params": [w]}, {"params": [v]}], lr=0.1), "stochastic")
    if HAVE_TORCHAO:
        from torchao.optim import AdamW8bit

        with pytest.raises(UsageError, match="8-bit Adam has no Kahan"):
            bf16.replace(AdamW8bit([w], lr=1e-3), "kahan")
        assert bf16.replace(AdamW8bit([w], lr=1e-3), "stochastic").bf16_stochastic_round
    argv = ["--accelerator", "cpu", "--precision", "32-true", "--bf16-update", "kahan"]
    with pytest.raises(SystemExit) as exc:
        cli.parse(RunConfig(), argv)
    assert exc.value.code == 2
    assert cli.parse(RunConfig(), [*argv[:3], "bf16-true", "--bf16-update", "kahan"]).bf16_update == "kahan"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("update", ["stochastic", "kahan"])
def test_the_replacements_follow_the_rungs_optimizer_on_fp32_weights(optimizer, update):
    """Same update rule: on fp32 weights (no rounding to fix) 50 steps land where torch's optimizer does."""
    if not fix_available(update, optimizer):
        pytest.skip(f"--bf16-update {update} needs a package that is not installed")
    torch.manual_seed(0)
    start, grads = torch.randn(1000), [torch.randn(1000) for _ in range(50)]

    def final(update_rule: str) -> torch.Tensor:
        w = start.clone().requires_grad_(True)
        base = torch.optim.SGD([w], lr=1e-2) if optimizer == "sgd" else torch.optim.Adam([w], lr=1e-3)
        opt = bf16.replace(base, update_rule)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        return w.detach()

    reference = final("plain")
    moved = (reference - start).abs().max()
    assert (final(update) - reference).abs().max() <= 1e-4 * moved


# ------------------------------------------------------------------ a fused kernel that applies no update
def test_a_fused_sgd_over_bf16_cpu_weights_moves_them_after_updates():
    """What the SGD rungs build (fused SGD) steps bf16 CPU weights by lr x grad after ``bf16.updates``,
    whatever this torch's fused CPU kernel does (torch 2.11's applies no update: it is then replaced)."""
    log, args = _log()
    w = torch.zeros(256, dtype=torch.bfloat16, requires_grad=True)
    opt = bf16.updates(torch.optim.SGD([w], lr=0.05, fused=True), args, log)
    w.grad = torch.full_like(w, 1e-2)
    opt.step()
    assert torch.equal(w.detach(), torch.full_like(w, -5e-4)), w[:4]  # -5e-4 rounded to bf16, every weight
    replaced = bf16.fused_cpu_sgd_drops_bf16_updates()
    assert ("fused_cpu_sgd" in log.updates) == replaced
    assert opt.param_groups[0]["fused"] is (not replaced)


def test_the_plain_kernel_replaces_only_a_fused_sgd_over_bf16_cpu_weights(monkeypatch):
    monkeypatch.setattr(bf16, "fused_cpu_sgd_drops_bf16_updates", lambda: True)
    bf = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    fp = torch.zeros(4, requires_grad=True)
    fused_bf16 = torch.optim.SGD([bf], lr=0.1, fused=True)
    assert bf16.unfuse_where_updates_drop(fused_bf16) and fused_bf16.param_groups[0]["fused"] is False
    assert not bf16.unfuse_where_updates_drop(torch.optim.SGD([fp], lr=0.1, fused=True))  # fp32: kept
    assert not bf16.unfuse_where_updates_drop(torch.optim.SGD([bf], lr=0.1))  # not fused: nothing to do
    assert not bf16.unfuse_where_updates_drop(torch.optim.Adam([bf], lr=0.1, fused=True))  # only SGD's
    monkeypatch.setattr(bf16, "fused_cpu_sgd_drops_bf16_updates", lambda: False)
    assert not bf16.unfuse_where_updates_drop(torch.optim.SGD([bf], lr=0.1, fused=True))


# ------------------------------------------------- compensated updates: SGD variants, schedules, defaults
def _sgd_run(w0: torch.Tensor, update: str, steps: int = 200, **hyper) -> torch.Tensor:
    """``steps`` SGD steps of gradient 1 under a cosine schedule after a linear warm-up (the rungs'
    schedulers, stepped as the loop steps them); returns the final weights as fp32."""
    from fabric_memory_recipes.training import loop

    w = w0.clone().requires_grad_(True)
    opt = bf16.replace(torch.optim.SGD([w], lr=2e-4, **hyper), update)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    schedule = loop.with_warmup(opt, cosine, 20)
    for _ in range(steps):
        w.grad = torch.ones_like(w)
        opt.step()
        schedule.step()
    return w.detach().float()


@pytest.mark.parametrize(
    "hyper",
    [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
        {"momentum": 0.5, "dampening": 0.5},
    ],
)
def test_stochastic_sgd_ends_on_average_where_fp32_sgd_does_under_a_warmed_up_cosine_schedule(hyper):
    """Updates far below half a bf16 step (at 1.0: 2^-8): plain bf16 SGD never moves; stochastic rounding
    moves the weights, on average to where the same SGD (momentum, weight decay, schedule) moves fp32 ones."""
    torch.manual_seed(0)
    reference = _sgd_run(torch.ones(8192), "plain", **hyper)  # fp32: nothing lost
    moved = 1.0 - reference.mean().item()
    assert moved > 2**-8, "the run must move the weights by more than one bf16 step in all"
    assert torch.all(_sgd_run(torch.ones(8192, dtype=torch.bfloat16), "plain", **hyper) == 1.0)
    sr = _sgd_run(torch.ones(8192, dtype=torch.bfloat16), "stochastic", **hyper)
    assert abs(sr.mean().item() - reference.mean().item()) < 0.03 * moved, (sr.mean(), reference.mean())
    assert sr.std().item() > 0


@pytest.mark.parametrize(
    "hyper", [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}]
)
def test_stochastic_sgd_is_torch_sgd_on_fp32_weights(hyper):
    torch.manual_seed(0)
    start, grads = torch.randn(1000), [torch.randn(1000) for _ in range(50)]
    final = {}
    for update in ("plain", "stochastic"):
        w = start.clone().requires_grad_(True)
        opt = bf16.replace(torch.optim.SGD([w], lr=1e-2, **hyper), update)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        final[update] = w.detach()
    moved = (final["plain"] - start).abs().max()
    assert (final["stochastic"] - final["plain"]).abs().max() <= 1e-5 * moved


def test_the_library_rounding_is_unbiased_too():
    """torchao's rounding (the SGD's, where torchao is installed) keeps the expected value, as ours does."""
    torch.manual_seed(0)
    step = 2.0**-7
    x = torch.full((200_000,), 1.0 + 0.25 * step)
    for rounding in (bf16.round_stochastic, bf16.library_rounding()):
        r = rounding(x).float()
        assert (r == 1.0 + step).float().mean().item() == pytest.approx(0.25, abs=0.01), rounding
        assert rounding(-x).float().mean().item() == pytest.approx(-x[0].item(), abs=step * 0.01), rounding
    assert (bf16.library_rounding() is bf16.round_stochastic) == (not HAVE_TORCHAO)


def test_the_stochastic_sgd_reads_a_tensor_learning_rate_as_a_captured_step_does():
    """Fast mode's graph reads each group's learning rate from a device vector (graphs.LearningRates);
    the schedulers keep writing the group's own tensor, and each step uses the value the vector holds."""
    from fabric_memory_recipes.training import graphs

    w = torch.zeros(16, requires_grad=True)
    opt = bf16.replace(torch.optim.SGD([w], lr=0.1, fused=True), "stochastic")
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor), "a float would be baked into a compiled step"
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    lrs = graphs.LearningRates([opt], torch.device("cpu"))
    moved = []
    for _ in range(4):
        lrs.sync()
        with lrs.as_tensors():  # the step reads the vector, as the replayed graph does
            assert opt.param_groups[0]["lr"].data_ptr() == lrs.values.data_ptr()
            before = w.detach().clone()
            w.grad = torch.ones_like(w)
            opt.step()
        moved.append((before - w.detach())[0].item())
        schedule.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and opt.param_groups[0]["lr"].item() == 0.0
    assert moved == pytest.approx([0.1, 0.1 * (1 + 2**-0.5) / 2, 0.05, 0.1 * (1 - 2**-0.5) / 2], rel=1e-4)


def test_the_sgd_step_compiles_as_one_graph(dynamo_on):
    """On CUDA each parameter's step runs compiled with ``fullgraph=True``: a graph break would fail
    there; traced here with dynamo (the eager backend: no compiler on the CPU), for both roundings."""
    from torch._dynamo.utils import counters

    counters.clear()
    traced = torch.compile(bf16.sgd_update, fullgraph=True, dynamic=False, backend="eager")
    roundings = (bf16.round_stochastic, bf16.library_rounding(), None)
    for rounding in roundings:
        p, g = torch.ones(64, dtype=torch.bfloat16), torch.full((64,), 0.5, dtype=torch.bfloat16)
        buf = torch.zeros_like(p)
        traced(p, g, buf, torch.tensor(0.25), 0.9, 0.0, 0.0, False, True, rounding)
        assert torch.all(p.float() == 0.875) and torch.all(buf.float() == 0.5)  # exact: no rounding due
    assert counters["stats"]["unique_graphs"] == len(set(roundings))  # traced: one graph per rounding


RECIPES = Path(__file__).resolve().parents[3] / "recipes"
RUNGS = sorted(p.stem for p in RECIPES.glob("[0-9][0-9]_*.py"))
COMPENSATED = ("04", "05", "06", "07", "10", "11", "12", "13", "14", "15")


@pytest.mark.parametrize("name", RUNGS)
def test_the_rungs_after_03_default_to_stochastic_rounding_and_rung_03_stays_plain(name):
    from fabric_memory_recipes.declarations import declared_rung

    rung = declared_rung(name)[0]
    expected = "stochastic" if name[:2] in COMPENSATED else "plain"
    assert rung.bf16_update == expected
    assert expected == "plain" or rung.precision == "bf16-true"


def _load(name: str):
    import runpy

    return runpy.run_path(str(RECIPES / f"{name}.py"))["RUNG"]


def test_the_default_rounding_reaches_the_optimizer_and_other_precisions_run_the_rungs_own():
    rung06, rung03 = _load("06_sgd_cosine"), _load("03_true_half_precision")
    cpu = ["--accelerator", "cpu"]
    assert cli.parse(rung06, cpu).bf16_update == "stochastic"
    assert cli.parse(rung06, [*cpu, "--bf16-update", "plain"]).bf16_update == "plain"
    assert cli.parse(rung03, cpu).bf16_update == "plain"
    assert cli.parse(rung03, [*cpu, "--bf16-update", "stochastic"]).bf16_update == "stochastic"
    # fp32 or mixed weights have nothing to round: the rung's default gives way, an explicit kahan is refused
    assert cli.parse(rung06, [*cpu, "--precision", "32-true"]).bf16_update == "plain"
    with pytest.raises(SystemExit):
        cli.parse(rung06, [*cpu, "--precision", "32-true", "--bf16-update", "kahan"])
    w = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
    log, _ = _log()
    opt = bf16.updates(torch.optim.SGD([w], lr=0.1, fused=True), cli.parse(rung06, cpu), log)
    assert isinstance(opt, bf16.StochasticRoundSGD) and log.updates["rule"] == "stochastic"
    per_param = {w: torch.optim.SGD([w], lr=0.1, fused=True)}  # rung 12: one optimizer per parameter
    out = bf16.updates(per_param, cli.parse(_load("12_optimizer_in_backward"), cpu), log)
    assert isinstance(out[w], bf16.StochasticRoundSGD)
    if HAVE_TORCHAO:
        adam = bf16.updates(
            torch.optim.Adam([w], lr=1e-3, fused=True), cli.parse(_load("04_lower_batch_size"), cpu), log
        )
        assert adam.bf16_stochastic_round and adam.param_groups[0]["weight_decay"] == 0


AB_COMPENSATED = (
    Path(__file__).resolve().parents[3] / "results" / "published" / "h200x4" / "ab" / "stochastic-rounding-ab"
)
CONVERGENCE_RUNS = (
    Path(__file__).resolve().parents[3] / "results" / "published" / "h100" / "convergence" / "runs"
)


@pytest.mark.parametrize("rung", COMPENSATED)
def test_each_compensated_rungs_page_states_its_committed_ab_and_accuracy(rung):
    """The numbers a rung page gives for its stochastic-rounding default are those of the committed A/B
    (plain base vs this default, one call) and of the convergence benchmark's runs."""
    import json
    import statistics

    [new] = AB_COMPENSATED.glob(f"ab-gpu*/new/fast/{rung}_*.json")
    base = Path(str(new).replace("/new/", "/base/"))
    b, n = json.loads(base.read_text()), json.loads(new.read_text())
    assert n["config"]["bf16_update"] == "stochastic" and b["config"].get("bf16_update", "plain") == "plain"
    rb, rn = b["memory"]["peak_reserved_gb"], n["memory"]["peak_reserved_gb"]
    ib, i_n = b["timing"]["images_per_s"], n["timing"]["images_per_s"]
    accuracy = [
        json.loads(p.read_text())["accuracy"]["test"]
        for p in CONVERGENCE_RUNS.glob(f"{rung}_*-default-s*.json")
    ]
    assert len(accuracy) == 3
    [page] = (RECIPES.parent / "docs").glob(f"{rung}_*.md")
    text = page.read_text()
    assert f"peak reserved {rb:.3f} → {rn:.3f} GB" in text
    assert f"{ib:.1f} → {i_n:.1f} img/s ({100 * (i_n / ib - 1):+.1f} %)" in text
    assert f"{statistics.mean(accuracy):.3f} ± {statistics.stdev(accuracy):.3f} (n=3)" in text
