"""Build a model without its weights, then read only the tensors a part of it needs from the checkpoint.

A pipeline stage holds only its layers' weights (AlpaServe §4.1: the planner gives each stage a share of the
model's memory), so a stage process should never hold the whole model, not even while loading. `parameters_on_meta`
builds any torch module with its parameters on the meta device (no memory; buffers stay real, since their values
are computed at construction and some are not in checkpoints), and `load_named` reads the named tensors from a
safetensors or torch checkpoint one tensor at a time, so that the rest of the file never enters the process.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

SAFETENSORS_SUFFIX = ".safetensors"
META = torch.device("meta")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, every parameter a module registers is moved to the meta device (buffers are not)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device != META:
            module._parameters[name] = nn.Parameter(param.to(META), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


#: safetensors dtype names -> torch dtypes (https://github.com/huggingface/safetensors, format section).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
#: Bytes of the little-endian header length that opens a safetensors file.
SAFETENSORS_LENGTH_BYTES = 8


class CheckpointTensors(contextlib.AbstractContextManager):
    """Tensors of a checkpoint file read one by one by name, never the whole file.

    safetensors: each tensor is read with one `readinto` into its own buffer (the file is not memory-mapped, so the
    process holds exactly the tensors asked for). A torch state dict (zip format) is memory-mapped privately and its
    tensors are returned as views, their pages read at once (`get`): only the tensors asked for become resident, and
    the first request does not page them in. A legacy (non-zip) torch file cannot be mapped and is read whole.
    """

    def __init__(self, path: str | Path, prefixes: Iterable[str] = ("",)):
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise FileNotFoundError(f"checkpoint file {self.path} does not exist")
        #: Tried in order before a module's tensor name, e.g. "bert." for a BertModel saved inside a task model.
        self.prefixes = tuple(prefixes)
        self._file = None
        self._state: dict[str, torch.Tensor] | None = None
        if self.path.suffix == SAFETENSORS_SUFFIX:
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed by __exit__
            length = int.from_bytes(self._file.read(SAFETENSORS_LENGTH_BYTES), "little")
            self._header = json.loads(self._file.read(length))
            self._header.pop("__metadata__", None)
            self._data_start = SAFETENSORS_LENGTH_BYTES + length
            self._names = set(self._header)
        else:
            try:
                state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a legacy (non-zip) torch file cannot be memory-mapped
                state = torch.load(self.path, map_location="cpu", weights_only=True)
            self._state = state["state_dict"] if isinstance(state, dict) and "state_dict" in state else state
            self._names = set(self._state)

    def key(self, name: str) -> str | None:
        """The checkpoint's key for a module tensor `name`, or None when the file does not hold it."""
        return next((prefix + name for prefix in self.prefixes if prefix + name in self._names), None)

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` of the checkpoint (ValueError naming it when the file lacks it)."""
        key = self.key(name)
        if key is None:
            raise ValueError(f"checkpoint {self.path} has no tensor {name!r}")
        if self._state is not None:
            tensor = self._state[key]
            tensor.sum()  # read its pages now (mapped files are paged in lazily)
            return tensor
        if self._file is None:
            raise ValueError(f"checkpoint {self.path} is closed")
        entry = self._header[key]
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"checkpoint {self.path}: tensor {key!r} has unsupported dtype {entry['dtype']!r}")
        begin, end = entry["data_offsets"]
        buffer = torch.empty(end - begin, dtype=torch.uint8)
        self._file.seek(self._data_start + begin)
        if self._file.readinto(buffer.numpy()) != end - begin:
            raise ValueError(f"checkpoint {self.path}: tensor {key!r} is truncated")
        return buffer.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._state = None


def load_named(module: nn.Module, names: Iterable[str], tensors: CheckpointTensors) -> int:
    """Replace the parameters and buffers `names` of `module` by the checkpoint's tensors; returns the bytes read.

    A parameter registered under several names (shared weights) is loaded once and set under all of them. A
    buffer the checkpoint lacks keeps its constructed value (non-persistent buffers are not saved); a parameter it
    lacks, or one whose shape differs, is a ValueError naming the tensor.
    """
    names = set(names)
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
            module.named_buffers(remove_duplicate=False)):
        aliases[id(tensor)].append(name)
    loaded = 0
    done: set[int] = set()
    for name in sorted(names):
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        current = owner._parameters.get(attr) if attr in owner._parameters else owner._buffers.get(attr)
        if current is None:
            raise ValueError(f"module has no parameter or buffer {name!r}")
        if id(current) in done:
            continue
        done.add(id(current))
        is_parameter = attr in owner._parameters
        if not is_parameter and tensors.key(name) is None:
            continue
        value = tensors.get(name)
        if tuple(value.shape) != tuple(current.shape):
            raise ValueError(f"checkpoint {tensors.path}: tensor {name!r} has shape {list(value.shape)}, the model "
                             f"expects {list(current.shape)}")
        replacement = nn.Parameter(value, requires_grad=current.requires_grad) if is_parameter else value
        for alias in aliases[id(current)]:
            alias_owner_path, _, alias_attr = alias.rpartition(".")
            alias_owner = module.get_submodule(alias_owner_path)
            store = alias_owner._parameters if is_parameter else alias_owner._buffers
            store[alias_attr] = replacement
        loaded += value.numel() * value.element_size()
    return loaded


def tensor_names(module: nn.Module, part: nn.Module | Iterable[nn.Module]) -> set[str]:
    """The names in `module` of every parameter and buffer that `part` (submodules of it) holds."""
    parts = [part] if isinstance(part, nn.Module) else list(part)
    wanted = {id(t) for p in parts for t in list(p.parameters()) + list(p.buffers())}
    return {name for name, t in list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)) if id(t) in wanted}


def meta_tensor_names(module: nn.Module) -> list[str]:
    """Parameters and buffers of `module` that are still on the meta device (not loaded)."""
    return [name for name, t in list(module.named_parameters()) + list(module.named_buffers()) if t.device == META]
