"""Weightless model building and by-name tensor reads (`models.partial_load`), and a text model's stages loaded from
its safetensors file one stage at a time (the vision / torch-checkpoint case is in test_parallel_planned_cuts)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from models.layers import parameter_bytes, run_layers
from models.partial_load import CheckpointTensors, load_named, meta_tensor_names, parameters_on_meta, tensor_names
from parallel.stage_layers import example_input, load_model, load_stage_layers, standalone_layers
from parallel.tensor_parallel import NoCollectives
from parallel.tiny_models import make_tiny_bert

MAX_ABS_DIFF = 1e-5
SEQ_LEN_TOKENS = 8


def test_parameters_on_meta_keeps_buffers_real_and_load_named_fills_only_the_named(tmp_path):
    with parameters_on_meta():
        module = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    assert module[0].weight.device.type == "meta" and module[1].running_mean.device.type == "cpu"
    reference = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    path = tmp_path / "weights.safetensors"
    save_file({name: t.contiguous() for name, t in reference.state_dict().items()}, str(path))
    with CheckpointTensors(path) as tensors:
        read = load_named(module, {"0.weight", "0.bias"}, tensors)
    assert read == sum(t.numel() * t.element_size() for t in reference[0].parameters())
    assert torch.equal(module[0].weight, reference[0].weight) and torch.equal(module[0].bias, reference[0].bias)
    assert meta_tensor_names(module) == ["1.weight", "1.bias"]


def test_a_tensor_of_the_wrong_shape_or_missing_is_a_value_error_naming_it(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"weight": torch.zeros(2, 4), "bias": torch.zeros(3)}, str(path))
    with parameters_on_meta():
        module = nn.Linear(4, 3)
    with CheckpointTensors(path) as tensors, pytest.raises(ValueError, match="'weight' has shape"):
        load_named(module, {"weight"}, tensors)
    with CheckpointTensors(path) as tensors, pytest.raises(ValueError, match="no tensor 'nonexistent.weight'"):
        tensors.get("nonexistent.weight")


def test_text_stages_read_only_their_tensors_from_safetensors_and_chain_to_the_unsplit_output(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    source = make_tiny_bert(tmp_path / "bert")
    model = load_model(source)
    layers = standalone_layers(model)
    read: list[str] = []
    original_get = CheckpointTensors.get
    monkeypatch.setattr(CheckpointTensors, "get", lambda self, name: read.append(name) or original_get(self, name))
    state = example_input(model, 2, SEQ_LEN_TOKENS)
    with torch.inference_mode():
        expected = run_layers(model.layers(), state).hidden
    for start, end in ((0, 1), (1, len(layers))):
        read.clear()
        sliced = load_stage_layers(source, start, end, NoCollectives())
        stage_tensors = tensor_names(model.model, layers[start:end])
        # Parameters are all read; a buffer (position ids) only where the checkpoint has it.
        parameters = {n for n, _ in model.model.named_parameters() if n in stage_tensors}
        assert parameters <= set(read) <= stage_tensors
        assert sliced.weight_bytes == parameter_bytes(nn.ModuleList(layers[start:end]))
        with torch.inference_mode():
            state = run_layers(sliced.layers, state)
    assert (state.hidden - expected).abs().max().item() <= MAX_ABS_DIFF
