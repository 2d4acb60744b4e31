"""fabric_memory_recipes.planning: exact static bytes, the PEFT and FSDP arithmetic, simulated activations against a
real run's saved tensors, and the simulated peak against a real CPU step's allocations (torch.profiler)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchvision.models.vision_transformer import VisionTransformer

from fabric_memory_recipes import planning
from fabric_memory_recipes.config import RunConfig
from fabric_memory_recipes.measurement.report import render
from fabric_memory_recipes.planning import check
from fabric_memory_recipes.planning.__main__ import main as estimate_main
from fabric_memory_recipes.planning.inference import simulate as inference_simulate
from fabric_memory_recipes.planning.simulation import modelled
from fabric_memory_recipes.training import data, models
from fabric_memory_recipes.training.techniques.checkpointing import CheckpointedBlock
from tests.conftest import REPO

GB = 1e9


# ------------------------------------------------------------------------------------------ fixtures
class TwoLinear(nn.Module):
    """Every tensor a multiple of 512 bytes in fp32 and bf16, so allocator rounding cannot blur sums."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 512)
        self.b = nn.Linear(512, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def linear_batch(batch: int = 16):
    def make():
        return (torch.empty(batch, 256),)

    def fn(model, b):
        out = model(b[0])
        return (out.float().pow(2).mean(),)

    return make, fn


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def small_vit(layers: int = 2) -> VisionTransformer:
    return VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=layers,
        num_heads=4,
        hidden_dim=128,
        mlp_dim=512,
        num_classes=10,
    )


def image_batch(model, batch: int = 8):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return (images, labels), data.image_classification(model.image_size)


def simulate(model, batch_fns=None, **plan):
    plan.setdefault("device", "cpu")
    plan.setdefault("optimizer_impl", "foreach")  # no per-parameter step counters in the sums
    make, fn = batch_fns or linear_batch()
    return planning.simulate(model, planning.Plan(**plan), make_batch=make, batch_fn=fn)


# -------------------------------------------------------------------------------- static arithmetic
@pytest.mark.parametrize(
    ("optimizer", "state_factor"), [("adam", 2), ("adamw", 2), ("sgd", 0), ("sgd-momentum", 1), ("none", 0)]
)
@pytest.mark.parametrize(("precision", "nbytes"), [("32-true", 4), ("bf16-true", 2), ("16-mixed", 4)])
def test_weights_grads_optimizer_state_are_exact(optimizer, state_factor, precision, nbytes):
    model = TwoLinear()
    p = numel(model)
    est = simulate(model, precision=precision, micro_batch_size=16, accumulation_steps=2, optimizer=optimizer)
    assert est.static_gb["weights"] == pytest.approx(p * nbytes / GB, abs=1e-9)
    assert est.static_gb["gradients"] == pytest.approx(p * nbytes / GB, abs=1e-9)
    assert est.static_gb["optimizer_state"] == pytest.approx(state_factor * p * nbytes / GB, abs=1e-9)
    # At the peak (a later micro-batch: gradients kept), the simulated storages hold exactly these bytes.
    c = est.components_gb
    assert c["parameters"] == pytest.approx(p * nbytes / GB, abs=1e-9)
    assert c["gradients"] == pytest.approx(p * nbytes / GB, abs=1e-9)
    assert c["optimizer_state"] == pytest.approx(state_factor * p * nbytes / GB, abs=1e-9)
    assert est.peak_gb == pytest.approx(sum(c.values()), abs=2e-6)


def test_fused_adam_keeps_one_step_counter_per_parameter_on_the_device():
    model = TwoLinear()
    est = simulate(model, micro_batch_size=16, accumulation_steps=2, optimizer="adam", optimizer_impl="fused")
    counters = 4 * planning.ALLOCATOR_ROUND  # 4 parameter tensors, one 512-byte block each
    assert est.components_gb["optimizer_state"] == pytest.approx(
        (2 * numel(model) * 4 + counters) / GB, abs=1e-9
    )


def test_peft_weights_k_plus_n_grads_n_adam_2n():
    """With K frozen and N trainable parameters: weights K+N, gradients N, Adam 2N."""
    model = TwoLinear()
    model.a.requires_grad_(False)
    k, n = numel(model.a), numel(model.b)
    est = simulate(model, micro_batch_size=16, accumulation_steps=2, optimizer="adam")
    assert est.parameters == {"total": k + n, "trainable": n}
    assert est.static_gb == pytest.approx(
        {"weights": 4 * (k + n) / GB, "gradients": 4 * n / GB, "optimizer_state": 8 * n / GB}
    )
    c = est.components_gb
    assert (c["parameters"], c["gradients"], c["optimizer_state"]) == pytest.approx(
        (4 * (k + n) / GB, 4 * n / GB, 8 * n / GB), abs=1e-9
    )


def test_fsdp_divides_sharded_state_by_world_size_and_offload_removes_it():
    model = TwoLinear()
    kw = dict(micro_batch_size=16, accumulation_steps=2, optimizer="adam", shard_units=("Linear",))
    one = simulate(model, **kw)
    four = simulate(model, sharding="fsdp", world_size=4, **kw)
    for key in ("weights", "gradients", "optimizer_state"):
        assert four.static_gb[key] == pytest.approx(one.static_gb[key] / 4, abs=1e-9)
    for key in ("parameters", "optimizer_state"):  # alive all step long (gradients: see static_gb)
        assert four.components_gb[key] == pytest.approx(one.components_gb[key] / 4, abs=1e-9)
    # the gathered units: the current and the prefetched one, plus one unit's unsharded gradients
    largest = max(numel(model.a), numel(model.b)) * 4
    assert four.components_gb["gathered_parameters"] == pytest.approx(3 * largest / GB, abs=1e-9)
    offload = simulate(model, sharding="fsdp", world_size=4, cpu_offload=True, **kw)
    assert offload.components_gb["parameters"] == offload.components_gb["optimizer_state"] == 0
    assert offload.peak_gb < four.peak_gb


def test_weights_offload_keeps_state_off_the_gpu_and_streams_two_units():
    """Rung 16: weights, gradients and Adam state in host memory; on the GPU at the peak (in backward) the
    block in use and the one before it, fetched ahead (bf16), and the resident rest; each gradient leaves
    at once (tests/planning/simulation/test_streamed_weights.py: the blocks WeightsOnCPU itself holds)."""
    model = small_vit(layers=3)
    (batch, fn) = image_batch(model, 4)
    kw = dict(micro_batch_size=4, precision="bf16-true", activation_checkpointing=("EncoderBlock",))
    plain = simulate(model, (lambda: batch, fn), **kw)
    streamed = simulate(model, (lambda: batch, fn), weights_offload=True, shard_units=("EncoderBlock",), **kw)
    assert set(streamed.static_gb.values()) == {0.0}
    c = streamed.components_gb
    assert c["parameters"] == c["gradients"] == c["optimizer_state"] == 0
    blocks = list(model.encoder.layers)
    unit, root = 2 * numel(blocks[0]), 2 * (numel(model) - sum(numel(b) for b in blocks))
    block = -(-unit // planning.ALLOCATOR_ROUND) * planning.ALLOCATOR_ROUND  # each copy one allocator block
    root = -(-root // planning.ALLOCATOR_ROUND) * planning.ALLOCATOR_ROUND
    assert c["gathered_parameters"] == pytest.approx((2 * block + root) / GB, abs=1e-9)
    assert streamed.peak_gb < plain.peak_gb
    assert streamed.to_dict()["assumptions"]["weights_offload"] is True


def test_plan_rejects_what_it_cannot_model():
    with pytest.raises(ValueError, match="optimizer"):
        planning.Plan(optimizer="lion")
    with pytest.raises(ValueError, match="cpu_offload"):
        planning.Plan(cpu_offload=True)
    with pytest.raises(ValueError, match="weights_offload"):
        planning.Plan(weights_offload=True)  # which modules are streamed?
    with pytest.raises(ValueError, match="weights_offload"):
        planning.Plan(weights_offload=True, shard_units=("Block",), sharding="fsdp")


def test_a_rungs_plan_comes_from_its_config():
    """The plan is the rung's flags and its declared technique, nothing else (no second declaration)."""
    rung = RunConfig(
        recipe="x",
        precision="bf16-true",
        batch_size=16,
        accumulation_steps=4,
        devices=4,
        optimizer="sgd",
        sharding="fsdp2",
        shard_units=("EncoderBlock",),
        activation_checkpointing=("EncoderBlock",),
    )
    plan = planning.plan_for(rung)
    assert (plan.precision, plan.micro_batch_size, plan.accumulation_steps) == ("bf16-true", 4, 4)
    assert (plan.optimizer, plan.sharding, plan.world_size, plan.activation_checkpointing) == (
        "sgd",
        "fsdp2",
        4,
        ("EncoderBlock",),
    )
    assert plan.device == "cuda"  # 'auto' predicts for a GPU
    replicated = planning.plan_for(RunConfig(devices=4, accelerator="cpu"))
    assert replicated.world_size == 1 and replicated.device == "cpu"  # replicas: per device as for one


# -------------------------------------------------------------------------- activations vs a real run
def real_saved(model, batch, fn, wrap=lambda m: m, backend=None) -> tuple[int, int]:
    """(exact, allocator-rounded) bytes a real forward pass saves, counted while its graph is alive."""
    wrapped = wrap(model)
    with contextlib.ExitStack() as stack:
        saved = stack.enter_context(planning.SavedTensorCounter([*wrapped.parameters(), *wrapped.buffers()]))
        if backend is not None:
            stack.enter_context(sdpa_kernel(backend))
        out = fn(wrapped, batch)  # noqa: F841 - keeps the graph (and what it saved) alive until counted
    return saved.nbytes, saved.rounded_nbytes


def simulated_saved(model, batch, fn, **plan) -> tuple[int, int]:
    """(exact, allocator-rounded) bytes that planning.simulate counts as saved by one forward pass."""
    est = planning.simulate(model, planning.Plan(device="cpu", **plan), make_batch=lambda: batch, batch_fn=fn)
    return est.activations_saved_bytes, round(est.activations_saved_gb * GB)


@pytest.mark.parametrize("attention", ["fused", "math"])
def test_simulated_activations_equal_the_bytes_a_real_forward_saves(attention):
    torch.manual_seed(0)
    model = small_vit()
    batch, fn = image_batch(model)
    real = real_saved(model, batch, fn, backend=SDPBackend.MATH if attention == "math" else None)
    assert simulated_saved(model, batch, fn, attention=attention) == real
    assert real[0] > 0


def test_math_attention_saves_the_score_matrix_fused_does_not():
    model = small_vit()
    batch, fn = image_batch(model, batch=8)
    fused, _ = simulated_saved(model, batch, fn, attention="fused")
    math, _ = simulated_saved(model, batch, fn, attention="math")
    seq, heads, layers = 17, 4, 2
    assert math - fused >= layers * 8 * heads * seq * seq * 4  # at least one fp32 (b, h, s, s) per block


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_simulated_activations_follow_fabric_precision_plugins(precision):
    import lightning as L

    torch.manual_seed(0)
    model = small_vit()
    batch, fn = image_batch(model)
    simulated = simulated_saved(model, batch, fn, precision=precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    real = real_saved(model, batch, fn, wrap=fabric.setup_module)
    assert simulated == real
    assert real[0] > 0


def test_frozen_blocks_save_less_and_checkpointing_shrinks_activations():
    torch.manual_seed(0)
    model = small_vit(layers=3)
    batch, fn = image_batch(model)
    full = simulated_saved(model, batch, fn)
    assert full == real_saved(model, batch, fn)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in [*models.blocks(model)[0].parameters(), *model.heads.parameters()]:
        p.requires_grad_(True)
    first = simulated_saved(model, batch, fn)
    assert first == real_saved(model, batch, fn)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in [*models.blocks(model)[-1].parameters(), *model.heads.parameters()]:
        p.requires_grad_(True)
    last = simulated_saved(model, batch, fn)
    assert last == real_saved(model, batch, fn)
    assert last[0] < first[0] < full[0]  # same trainable count for first and last, very different memory
    for p in model.parameters():
        p.requires_grad_(True)
    ckpt = simulated_saved(model, batch, fn, activation_checkpointing=("EncoderBlock",))
    assert ckpt[0] < full[0] / 3
    # a model that checkpoints itself (rung 10's CheckpointedBlock) saves what the plan predicts
    for i, block in enumerate(models.blocks(model)):
        model.encoder.layers[i] = CheckpointedBlock(block)
    assert real_saved(model, batch, fn) == ckpt


# -------------------------------------------------------------------------- the peak vs a real CPU step
def measured_cpu_peak(model, optimizer, batch, fn, k: int = 1) -> int:
    """Peak of live CPU bytes during one steady-state step, from torch.profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    def step():
        for _ in range(k):
            (fn(model, batch)[0] / k).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as p:
        step()
    _, sizes = MemoryProfileTimeline(p._memory_profile())._coalesce_timeline("cpu")
    return max(sum(s) for s in sizes)


@pytest.mark.parametrize(
    ("k", "optimizer", "checkpoint"), [(1, "adam", False), (2, "sgd", False), (1, "adam", True)]
)
def test_simulated_peak_matches_a_real_cpu_step(k, optimizer, checkpoint):
    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=64, patch_size=8, num_layers=2, num_heads=4, hidden_dim=256, mlp_dim=1024, num_classes=10
    )
    batch, fn = image_batch(model, batch=4)
    plan = planning.Plan(
        device="cpu",
        micro_batch_size=4,
        accumulation_steps=k,
        optimizer=optimizer,
        optimizer_impl="for-loop",
        activation_checkpointing=("EncoderBlock",) if checkpoint else (),
    )
    predicted = planning.simulate(model, plan, make_batch=lambda: batch, batch_fn=fn).peak_gb * GB
    if checkpoint:
        for i, block in enumerate(models.blocks(model)):
            model.encoder.layers[i] = CheckpointedBlock(block)
    cls = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    measured = measured_cpu_peak(model, cls(model.parameters(), lr=1e-3, foreach=False), batch, fn, k)
    assert predicted == pytest.approx(measured, rel=0.02)


# ------------------------------------------------------------------------------ modelled techniques
def test_the_attention_stand_ins_are_put_back_after_an_error_and_agree_on_flash():
    real = nn.functional.scaled_dot_product_attention
    for stand_in in (
        modelled.attention_kernel("fused", "cuda", set()),
        inference_simulate._sdpa_on_cuda(set()),
    ):
        with pytest.raises(RuntimeError, match="inside"), stand_in:
            assert nn.functional.scaled_dot_product_attention is not real
            raise RuntimeError("inside")
        assert nn.functional.scaled_dot_product_attention is real
    query = torch.empty(1, 2, 4, 64, dtype=torch.bfloat16, device="meta")
    assert modelled.cuda_runs_flash(query, None)
    assert not modelled.cuda_runs_flash(query, torch.empty(4, 4, device="meta"))  # a mask: efficient
    assert not modelled.cuda_runs_flash(query.float(), None)  # fp32: efficient
    assert not modelled.cuda_runs_flash(query[..., :12], None)  # a head size flash does not take


class BiasedAttention(nn.Module):
    """T5's attention in miniature: q, k, v projections and a learned position bias stored (q, k, heads)
    and permuted to (1, heads, q, k), so the mask's last dimension has stride ``heads``; attention dropout."""

    B, L, E, H = 4, 64, 128, 4

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(self.E, self.E, bias=False) for _ in range(3))
        self.bias = nn.Parameter(torch.zeros(self.L, self.L, self.H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).view(self.B, self.L, self.H, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        mask = self.bias.permute(2, 0, 1).unsqueeze(0)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1, scale=1.0)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_eager_cuda_runs_a_strided_mask_on_math_with_a_bool_dropout_mask(precision):
    """CUDA's fused kernels refuse a mask whose last dimension is strided: eager CUDA runs math, which
    computes in fp32 inside (autocast is off in it) and whose dropout is CUDA's fused one. It saves x (bf16
    under autocast) for the projections, the scaled q and k and v in fp32 for the two
    matrix products, the softmax's output and the dropped-out weights in fp32, and a bool dropout mask."""
    m = BiasedAttention()
    b, seq, e, h = m.B, m.L, m.E, m.H
    mixed = precision == "bf16-mixed"

    def run(compiled: bool):
        make = lambda: (torch.empty(b, seq, e),)  # noqa: E731
        fn = lambda model, batch: (model(batch[0]).float().sum(),)  # noqa: E731
        plan = planning.Plan(precision=precision, micro_batch_size=b, compile=compiled)
        return planning.simulate(m, plan, make_batch=make, batch_fn=fn)

    eager = run(compiled=False)
    inputs = b * seq * e * (2 if mixed else 4)  # x (no gradient: the weights' copies are not kept)
    qkv = 3 * b * h * seq * (e // h) * 4
    scores = b * h * seq * seq
    assert eager.kernels == [modelled.STRIDED_FALLBACK]
    assert eager.activations_saved_bytes == inputs + qkv + scores * (4 + 4 + 1)
    # compiled blocks that run their eager graph here (checkpointed ones) count the fused kernel
    assert run(compiled=True).kernels == ["efficient"]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_compiled_block_keeps_what_inductors_partition_keeps(precision):
    """A compiled block runs its math attention as inductor partitions it. In fp32 it keeps what eager keeps
    (x, q, k, v, the softmax's output, the dropped-out weights, the bool mask); under autocast it keeps q, k
    and v in bf16 (made fp32 again in backward) and recomputes the dropped-out weights from the softmax's
    output and the mask, where eager keeps fp32 copies of q, k, v and the dropped-out weights in fp32."""
    m = BiasedAttention()
    b, seq, e, h = m.B, m.L, m.E, m.H
    make = lambda: (torch.empty(b, seq, e),)  # noqa: E731
    fn = lambda model, batch: (model(batch[0]).float().sum(),)  # noqa: E731
    plan = planning.Plan(
        precision=precision, micro_batch_size=b, compile=True, compiled_blocks=("BiasedAttention",)
    )
    est = planning.simulate(m, plan, make_batch=make, batch_fn=fn)
    width = 2 if precision == "bf16-mixed" else 4
    scores = b * h * seq * seq
    if precision == "bf16-mixed":  # x, q, k, v in bf16; the softmax's output (fp32) and the mask
        assert est.activations_saved_bytes == 4 * b * seq * e * width + scores * (4 + 1)
    else:
        assert est.activations_saved_bytes == 4 * b * seq * e * width + scores * (4 + 4 + 1)
    assert est.kernels == [modelled.STRIDED_FALLBACK]


def test_cross_entropy_under_cuda_autocast_keeps_the_bf16_log_probabilities_and_an_fp32_copy():
    """CUDA autocast has no policy for cross_entropy_loss (CPU autocast runs it in fp32): its log_softmax
    keeps bf16 logits' dtype and nll_loss, an fp32 op, copies them to fp32; both are kept for backward."""
    logits = torch.zeros(4, 10, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), modelled.cuda_autocast_policy(True):
        loss = nn.functional.cross_entropy(logits, torch.zeros(4, dtype=torch.long))
        given = torch.softmax(logits, -1, dtype=torch.bfloat16)  # a dtype given: run as called
    nll = loss.grad_fn
    assert nll._saved_self.dtype == torch.float32
    log_softmax = nll.next_functions[0][0].next_functions[0][0]
    assert type(log_softmax).__name__ == "LogSoftmaxBackward0"
    assert log_softmax._saved_result.dtype == torch.bfloat16
    assert (
        given.dtype == torch.bfloat16
        and type(given.grad_fn.next_functions[0][0]).__name__ != "ToCopyBackward0"
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast's own once the policy is put back
        cpu = nn.functional.cross_entropy(logits, torch.zeros(4, dtype=torch.long)).grad_fn
    assert type(cpu.next_functions[0][0]).__name__ == "LogSoftmaxBackward0"  # an fp32 log_softmax


def test_cuda_dropout_keeps_a_bool_mask_and_is_put_back():
    x = torch.ones(8, 64, requires_grad=True)
    with modelled.cuda_dropout(True):
        assert type(nn.functional.dropout(x, 0.5, True).grad_fn).__name__ == "NativeDropoutBackward0"
        assert nn.functional.dropout(x, 0.5, False) is x  # evaluation: the input itself, as aten's
    assert type(nn.functional.dropout(x, 0.5, True).grad_fn).__name__ == "MulBackward0"  # the CPU's own


def test_optimizer_in_backward_activation_offload_and_8bit_state():
    torch.manual_seed(0)
    model = small_vit()
    fns = (lambda: image_batch(model)[0], image_batch(model)[1])
    base = simulate(model, fns, micro_batch_size=8, optimizer="sgd")
    in_backward = simulate(model, fns, micro_batch_size=8, optimizer="sgd", optimizer_in_backward=True)
    assert in_backward.components_gb["gradients"] < base.static_gb["gradients"] / 2
    offload = simulate(
        model, fns, micro_batch_size=8, optimizer="sgd", activation_offload=True, offload_min_bytes=0
    )
    assert offload.components_gb["activations"] < base.components_gb["activations"] / 10
    assert offload.activations_host_gb > 0.8 * base.activations_saved_gb
    big = nn.Linear(1024, 1024, bias=False)  # 8-bit moments: 1 byte + a 4-byte scale per 256 values
    lowbit = simulate(
        big, (lambda: (torch.empty(4, 1024),), lambda m, b: (m(b[0]).sum(),)), optimizer="adamw8bit"
    )
    assert lowbit.static_gb["optimizer_state"] == pytest.approx(
        2 * (1024 * 1024 * (1 + 4 / 256) + 256 * 4) / GB
    )


def test_simulation_leaves_no_trace_behind():
    """Autocast policy, SDPA, default dtype and the model's own parameters are restored afterwards."""
    import torch.nn.functional as F

    model = small_vit()
    params = dict(model.named_parameters())
    sdpa = F.scaled_dot_product_attention
    planning.simulate(model, planning.Plan(precision="16-mixed", device="cuda", micro_batch_size=4))
    planning.simulate(model, planning.Plan(precision="bf16-true", micro_batch_size=4))
    assert F.scaled_dot_product_attention is sdpa
    assert torch.get_default_dtype() == torch.float32
    assert all(p is params[n] for n, p in model.named_parameters())
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(x, (8,)).dtype == torch.bfloat16  # CPU autocast's own policy is back
    batch, fn = image_batch(model)
    fn(model, batch)[0].backward()  # a real step still works (no fake tensors cached)


def test_the_simulation_asks_once_whether_cuda_is_available(monkeypatch):
    """torch's fake mode asks for every op it has no cached answer for (1127 times for this step in a fresh
    process), and with Lightning's NVML-based check (PYTORCH_NVML_BASED_CUDA_CHECK=1) each ask loads NVML
    again: the simulation's fake mode asks once."""
    asked, real = [], torch.cuda.is_available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or real())
    est = planning.simulate(
        small_vit(), planning.Plan(precision="bf16-mixed", device="cuda", micro_batch_size=4)
    )
    assert est.peak_gb > 0 and len(asked) == 1


def test_estimate_inside_init_module_like_defaults_is_unchanged():
    """Recipes may call for_run inside fabric.init_module(): another default device and dtype."""
    model = small_vit()
    plan = planning.Plan(precision="bf16-true", micro_batch_size=4, device="cpu")
    plain = planning.simulate(model, plan).peak_gb
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            inside = planning.simulate(model, plan).peak_gb
        assert torch.get_default_dtype() == torch.bfloat16
    finally:
        torch.set_default_dtype(previous)
    assert inside == plain


def test_for_run_records_a_failure_instead_of_raising():
    class Broken(nn.Module):
        image_size = 32

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("no forward today")

    est = planning.for_run(Broken(), RunConfig(batch_size=4, model="broken"))
    assert est.peak_gb is None and "no forward today" in est.error
    assert est.to_dict()["error"] == est.error


# -------------------------------------------------------------------------------------- CLI and report
def test_cli_predicts_a_ladder_rung_in_seconds(capsys):
    assert estimate_main(["--recipe", "05", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"] == "05_gradient_accumulation"
    assert out["assumptions"]["attention_kernel"] == "fused"
    assert out["assumptions"]["micro_batch_size"] == 4 and out["assumptions"]["accumulation_steps"] == 4
    # ViT-L/16, bf16, fused Adam: 0.61 weights + 0.61 grads + 1.21 Adam + activations of a micro-batch of 4
    assert 2.9 < out["peak_allocated_gb"] < 3.4
    assert out["seconds"] < 60
    assert estimate_main(["--recipe", "06_sgd", "--model", "vit_tiny", "--batch-size", "8"]) == 0
    table = capsys.readouterr().out
    assert "predicted peak" in table and "optimizer sgd" in table


def test_ladder_predicts_the_rungs_of_a_cpu_folder_at_full_size(tmp_path, capsys):
    """--ladder DIR: the rungs with results in DIR (tiny CPU runs), each predicted as ViT-L/16 in its
    GPU configuration, written to DIR/predicted.json (the CPU track's memory columns). One sharded rung
    here (per GPU of its declared 4); tests/recipes/test_run_all.py and the notebook's test predict the rest."""
    (tmp_path / "08_fsdp2.json").write_text(json.dumps({"schema_version": 1, "recipe": "08_fsdp2"}))
    (tmp_path / "notes.json").write_text("[]")
    assert estimate_main(["--ladder", str(tmp_path)]) == 0
    assert "predicted.json" in capsys.readouterr().out
    payload = json.loads((tmp_path / "predicted.json").read_text())
    assert payload["what"] == "predicted (ViT-L/16, GPU config)"
    (row,) = payload["rows"]
    assert row["recipe"] == "08_fsdp2" and row["error"] is None
    assert row["config"] == {**row["config"], "model": "vit_l_16", "precision": "32-true", "devices": 4}
    # 1.21 GB of sharded state per GPU, plus a batch of 64's checkpointed block inputs and one block at a time
    assert row["static_gb"]["weights"] == pytest.approx(1.2132 / 4, abs=1e-3)
    assert 3.0 < row["peak_allocated_gb"] < 4.0


def test_check_and_report_compare_prediction_with_measurement(tmp_path, capsys):
    result = {
        "schema_version": 1,
        "recipe": "05_gradient_accumulation",
        "status": "ok",
        "config": {"precision": "bf16-true", "batch_size": 16, "accumulation_steps": 4, "micro_batch_size": 4,
                   "devices": 1, "num_nodes": 1, "compile": False, "model": "vit_tiny", "accelerator": "cuda"},
        "provenance": {"gpu_name": "NVIDIA H100 80GB HBM3", "world_size": 1},
        "memory": {"kind": "cuda", "peak_allocated_gb": 0.08},
    }  # fmt: skip
    (tmp_path / "05_gradient_accumulation.json").write_text(json.dumps(result))
    rows = planning.check_results([str(tmp_path)])
    assert len(rows) == 1
    row = rows[0]
    assert row["error_pct"] == pytest.approx(100 * (row["predicted_gb"] - 0.08) / 0.08)
    result["estimate"] = {"peak_allocated_gb": 0.084, "peak_phase": "backward", "assumptions": {}}
    assert render.estimate_error_pct(result) == pytest.approx(5.0)
    assert "+5.0%" in render.render_estimates([result])
    # a run that recorded its own prediction is compared with that one, not re-simulated
    (tmp_path / "05_gradient_accumulation.json").write_text(json.dumps(result))
    # a recipe the estimator does not model (the Hugging Face bonus models) is left out, not a crash
    bonus = {
        **result,
        "recipe": "bonus_bigbird_after",
        "config": {**result["config"], "model": "google/bigbird-roberta-base"},
    }
    bonus.pop("estimate")
    (tmp_path / "bonus_bigbird_after.json").write_text(json.dumps(bonus))
    rows = planning.check_results([str(tmp_path)])
    assert [r["recipe"] for r in rows] == ["05_gradient_accumulation"]
    assert rows[0]["predicted_gb"] == 0.084 and rows[0]["error_pct"] == pytest.approx(5.0)


CHECKED_RUN = {
    "schema_version": 1, "recipe": "05_gradient_accumulation", "status": "ok",
    "config": {"precision": "bf16-true", "batch_size": 16, "accumulation_steps": 4, "micro_batch_size": 4,
               "devices": 1, "num_nodes": 1, "compile": False, "model": "vit_tiny", "accelerator": "cuda"},
    "provenance": {"gpu_name": "NVIDIA H100 80GB HBM3", "world_size": 1},
    "memory": {"kind": "cuda", "peak_allocated_gb": 0.08},
    "estimate": {"peak_allocated_gb": 0.084, "peak_phase": "backward", "assumptions": {}},
}  # fmt: skip


def test_check_of_a_folder_with_nothing_to_compare_says_why_in_one_line(tmp_path, capsys):
    """It printed an empty table header and exited 2 with no reason (a CPU ladder, an empty folder,
    broken files)."""
    cpu = {**CHECKED_RUN, "memory": {"kind": "cpu_rss", "peak_allocated_gb": 0.1}}
    (tmp_path / "05_gradient_accumulation.json").write_text(json.dumps(cpu))
    (tmp_path / "01_baseline.json").write_text("")
    (tmp_path / "run_all.json").write_text(json.dumps({"started": 0, "recipes": []}))  # not a run: not named
    assert estimate_main(["--check", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "", "no empty table"
    (line,) = err.strip().splitlines()
    assert f"--check {tmp_path}: nothing to compare: no results JSON" in line, line
    assert "1 measured on the CPU" in line and "01_baseline.json: unreadable (empty)" in line, line
    assert "run_all.json" not in line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert estimate_main(["--check", str(empty)]) == 2
    assert "(found: no JSON files)" in capsys.readouterr().err


def test_check_names_the_files_it_could_not_read(tmp_path, capsys):
    """With good rows beside them, truncated and empty JSON files were dropped without a word."""
    good = json.dumps(CHECKED_RUN, indent=2)
    (tmp_path / "05_gradient_accumulation.json").write_text(good)
    (tmp_path / "01_baseline.json").write_text(good[:200])
    (tmp_path / "02_mixed_precision.json").write_text("")
    assert estimate_main(["--check", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "05_gradient_accumulation" in out
    (line,) = err.strip().splitlines()
    assert "skipped 2 file(s): 01_baseline.json: unreadable (truncated or not JSON" in line, line
    assert "02_mixed_precision.json: unreadable (empty)" in line, line


def test_the_ladder_and_the_check_share_their_simulated_steps(tmp_path):
    """--ladder keeps a rung's step in the planner's cache under the key --check gives the committed run of
    the same configuration: predicted again, or replayed for the check of rung 04's committed run, nothing is
    simulated, and the row is the fresh simulation's. Processes that share the file keep each other's entries."""
    from types import SimpleNamespace

    from fabric_memory_recipes.planning import check, ladder
    from fabric_memory_recipes.planning.simulation.cache import SimulationCache

    path = str(tmp_path / "simulations.json")
    first = SimulationCache(path)
    fresh = ladder.predict("04_lower_batch_size", first)
    assert first.simulated == 1 and fresh["error"] is None and fresh["components_gb"]["activations"] > 0
    again = SimulationCache(path)
    assert {**ladder.predict("04_lower_batch_size", again), "seconds": 0} == {**fresh, "seconds": 0}
    committed = json.loads((REPO / "results/published/h100/ladder/04_lower_batch_size.json").read_text())
    assert check.replayed_of(committed, again) == first.entries[next(iter(first.entries))][2]
    assert again.simulated == 0

    one, other = SimulationCache(path), SimulationCache(path)  # two processes, each adding a step
    step = SimpleNamespace(error=None, peak_gb=1.0, activations_host_gb=0.0, reserved_gb=1.5, seconds=0.1)
    one.lookup("a", lambda: step, "a")
    other.lookup("b", lambda: step, "b")
    assert {'"a"', '"b"'} <= set(SimulationCache(path).entries) and len(SimulationCache(path).entries) == 3


def test_ladder_of_a_folder_without_results_is_every_rung(tmp_path, monkeypatch):
    from fabric_memory_recipes.planning import ladder

    monkeypatch.setattr(
        ladder,
        "predict",
        lambda recipe: {
            "recipe": recipe,
            "peak_allocated_gb": 1.0,
            "error": None,
            "config": {"model": "vit_l_16", "precision": "x", "batch_size": 1, "devices": 1},
            "seconds": 0.0,
        },
    )
    payload = ladder.predict_ladder(tmp_path / "new", say=lambda line: None)
    names = [r["recipe"] for r in payload["rows"]]
    assert names[0] == "01_baseline" and "09_cpu_offload" in names and names[-1] == "16_weights_on_cpu"
    assert len(names) == len(list((ladder.RECIPES_DIR).glob("[0-9][0-9]_*.py")))
    assert json.loads((tmp_path / "new" / "predicted.json").read_text()) == payload


def test_a_committed_run_that_recorded_your_models_fields_is_simulated_again():
    """A ladder run's recorded assumptions may name fields the ladder's plan has not (``fused_loss``, your
    model's): simulating it again takes the plan's own fields and leaves the rest (it raised TypeError)."""
    result = json.loads(
        (REPO / "results/published/h100/quick-check/10_activation_checkpointing.json").read_text()
    )
    assert "fused_loss" in result["estimate"]["assumptions"]
    result["estimate"]["assumptions"]["micro_batch_size"] = (
        1  # a small step: the plan's fields are what count
    )
    est = check.simulate_run(result)
    assert est.error is None and 0 < est.peak_gb <= est.reserved_gb
