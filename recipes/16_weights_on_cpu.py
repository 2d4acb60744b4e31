"""Rung 16 - weights on the CPU: a full fine-tune whose weights, gradients and Adam state live in host memory.

Each block's weights reach the GPU as a bf16 copy just before it runs (one block ahead) and leave after it;
each gradient goes back as soon as backward makes it, and a CPU thread runs that block's fused Adam step on
fp32 masters while the GPU goes on (not delayed). Rungs 10 and 11 keep the activations small.
The streaming: fabric_memory_recipes/training/techniques/weights_offload.py: WeightsOnCPU.
"""

import fabric_memory_recipes  # noqa: F401, I001 - first: a Ctrl-C while torch loads is one line, exit 130
import contextlib
from dataclasses import dataclass

import lightning as L
import torch

from fabric_memory_recipes import planning
from fabric_memory_recipes.config import BOOL, RunConfig, UsageError, flag
from fabric_memory_recipes.training import data, lifecycle, loop, models
from fabric_memory_recipes.training.techniques import checkpointing, offload, weights_offload


@dataclass
class WeightsOnCPUConfig(RunConfig):  # rung 16's own flags: points of the memory-against-speed curve
    checkpointing: bool = flag(True, "training", "checkpoint every block (rung 10)", action=BOOL)
    activation_offload: bool = flag(True, "training", "saved block inputs in host memory (rung 11)", action=BOOL)  # fmt: skip


RUNG = WeightsOnCPUConfig(
    recipe="16_weights_on_cpu",
    precision="bf16-true",  # on the GPU: bf16 weights, gradients and activations (fp32 masters on the CPU)
    batch_size=24,  # rung 16: under the model's own bf16 size (0.61 GB) at >= 100 img/s on one H100
    mode="eager",  # no compile, no CUDA graph: hooks move the weights around every block (optimizer: Adam)
    optimizer_in_backward=True,  # each gradient leaves the GPU during backward: no accumulation
    weights_offload=True,  # rung 16, for the estimate: weights, gradients and Adam state in host memory
    shard_units=("EncoderBlock",),  # rung 16, for the estimate: the blocks streamed one at a time
    activation_checkpointing=("EncoderBlock",),  # rung 10 (--no-checkpointing: none)
)


def main(cfg: WeightsOnCPUConfig, results) -> None:
    if cfg.compile or cfg.cuda_graphs or cfg.checkpoint_every or cfg.resume:  # hooks run around every block
        raise UsageError("rung 16 runs eagerly, without --compile/--cuda-graphs/--checkpoint-every/--resume")
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")  # "high" = TF32 matmuls
    fabric = L.Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                      precision=cfg.precision, loggers=results.fabric_loggers())  # fmt: skip
    fabric.launch()
    fabric.seed_everything(cfg.seed, verbose=False)  # the seed is in the results JSON
    results.attach(fabric)
    splits = data.load(cfg.data, cfg.data_dir)  # one process
    weights = models.resolve_weights(cfg.model, cfg.weights)
    results.set(data_source=splits.source, weights="pretrained" if weights else "random")
    with results.phase("model_load"):
        model = models.build_model(cfg.model, weights, data.NUM_CLASSES, cfg.image_size)  # rung 16: CPU, fp32
        if cfg.checkpointing:  # rung 10: each block keeps its input only
            checkpointing.checkpoint_blocks(model, ("EncoderBlock",))
        planning.instrument(results, model, cfg)  # records the estimate and the model's size
        adam = lambda params: torch.optim.Adam(params, lr=cfg.lr, fused=True)  # noqa: E731 - rung 16: CPU kernel
        # rung 16: the weights become fp32 masters on the host, one Adam per block; the model keeps bf16 views
        streamed = weights_offload.WeightsOnCPU(model, models.blocks(model), fabric.device, adam,
                                                weights_offload.transfer_dtype(cfg.precision))  # fmt: skip
        model = fabric.setup(model)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(*data.loaders(splits, cfg, fabric))
    image_batch = data.image_classification(model.image_size)
    offloaded = offload.offload_activations() if cfg.activation_offload else contextlib.nullcontext()

    def batch_fn(model, batch):
        with offloaded:  # rung 11: what the checkpoints save goes to host memory
            return image_batch(model, batch)

    with results.phase("train"):  # rung 12's "optimizer None": the updates happen during backward
        loop.fit(fabric, model, None, train_loader, batch_fn, cfg, results)
        streamed.finish()  # the last CPU steps are part of training
    results.extra.update(streamed.timings(), host_gb=streamed.host_bytes() / 1e9)
    with results.phase("eval"):
        loop.evaluate_splits(fabric, model, val_loader, test_loader, batch_fn, results, cfg.eval_batches)


if __name__ == "__main__":
    raise SystemExit(lifecycle.run_recipe(main, RUNG, __doc__))
