"""The estimate builds the user's model on the meta device, or, where its constructor computes with tensor values,
on the CPU and moves it there (training/your_model/models.py ``build_on_meta``)."""

import pytest
import torch

from fabric_memory_recipes.planning.your_model.estimate import meta_user_model
from fabric_memory_recipes.training.your_model import models


def test_a_constructor_that_reads_tensor_values_is_built_on_the_cpu_and_moved_to_meta():
    with pytest.raises(NotImplementedError, match="meta"), torch.device("meta"):
        models.build(models.resolve("torchvision:regnet_y_400mf"))  # its widths: .tolist() of a tensor
    um, model, blocks, _ = meta_user_model("torchvision:regnet_y_400mf")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert blocks  # its repeated blocks found as for any model


def test_other_models_are_built_on_meta_directly(monkeypatch):
    built = []
    monkeypatch.setattr(
        models, "build", lambda um: built.append(torch.empty(1).device.type) or torch.nn.Linear(2, 2)
    )
    assert models.build_on_meta(models.resolve("torchvision:resnet18")).weight.device.type == "meta"
    assert built == ["meta"]  # built once, under the meta device
