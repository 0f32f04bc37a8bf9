"""One weight validator for every engine, and the one safetensors header reader.

A weight update is checked before any engine applies it, so a bad one changes nothing:
every tensor the model has must be present (names in `optional`, such as a tied
`lm_head.weight`, may be left out), none it lacks, each with the model's shape, a
floating-point dtype and (for tensors in memory, or a file read in full) finite values.
The same checks run on a state dict in memory or on a safetensors file's header, with one
set of messages, raised as InvalidArgument: field "state_dict" for a bad tensor, "payload"
for a file that is missing or not safetensors.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from scalerl.policy.lora import LORA_A, Payload, adapter_shapes, split_payload
from scalerl.rpc.errors import InvalidArgument

# safetensors dtype names of the floating-point dtypes a weight may have.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})

Header = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, safetensors dtype)


def read_header(path: str | Path) -> Header:
    """Tensor name -> (shape, dtype name such as "F32") from a safetensors file's header,
    without reading the data. Raises InvalidArgument("payload", ...) when the file is
    missing, truncated or not safetensors."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument("payload", f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}
            return {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
    except (OSError, SafetensorError) as exc:
        raise _not_safetensors(path, exc) from exc


def folder_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every *.safetensors file of a model folder (empty when it
    holds none). Raises InvalidArgument as `read_header`."""
    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        shapes.update({name: shape for name, (shape, _) in read_header(file).items()})
    return shapes


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (on the CPU). Raises InvalidArgument("payload",
    ...) as `read_header`."""
    if not Path(path).is_file():
        raise InvalidArgument("payload", f"{path} does not exist")
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise _not_safetensors(Path(path), exc) from exc


class WeightSpec:
    """The tensors a model takes: shapes (name -> shape; None = not known, then only
    dtypes and values are checked) and the names that may be left out."""

    def __init__(
        self, shapes: Mapping[str, Sequence[int]] | None, optional: Collection[str] = ()
    ) -> None:
        self.shapes = None
        if shapes is not None:
            self.shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        self.optional = frozenset(optional)

    def check_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Validate tensors in memory: names, shapes, floating dtype, finite values.
        Raises InvalidArgument("state_dict", ...) naming the first bad tensor (in the
        model's order)."""
        for name in self._names_in_order(state_dict):
            tensor = state_dict[name]
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise _bad_dtype(name, kind)
            self._check_shape(name, tuple(tensor.shape))
            if not bool(torch.isfinite(tensor).all()):
                raise _non_finite(name)

    def check_header(self, header: Header) -> None:
        """Validate a safetensors header (`read_header`): names, shapes, dtypes. Raises
        InvalidArgument("state_dict", ...) naming the first bad tensor."""
        for name in self._names_in_order(header):
            shape, dtype = header[name]
            self._check_shape(name, shape)
            if dtype not in FLOAT_DTYPES:
                raise _bad_dtype(name, dtype)

    def check_file(self, path: str | Path, values: bool = True) -> None:
        """Validate a safetensors file: its header, then (values=True) every tensor's values
        for NaN or infinities, one tensor in memory at a time. Raises InvalidArgument:
        "payload" for an unreadable file, "state_dict" for a bad tensor."""
        self.check_header(read_header(path))
        if not values:
            return
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    if not bool(torch.isfinite(handle.get_tensor(name)).all()):
                        raise _non_finite(name)
        except (OSError, SafetensorError) as exc:
            raise _not_safetensors(Path(path), exc) from exc

    def _names_in_order(self, given: Iterable[str]) -> list[str]:
        """The given names in the model's order, after the name checks (unknown, then
        missing); in the given order when the shapes are not known."""
        names = list(given)
        if not names:
            raise InvalidArgument("state_dict", "holds no tensors")
        if self.shapes is None:
            return names
        unknown = sorted(set(names) - set(self.shapes))
        if unknown:
            raise InvalidArgument(
                "state_dict",
                f"unknown tensor {unknown[0]!r}: the model has no parameter of that name",
            )
        present = set(names)
        for name in self.shapes:
            if name not in present and name not in self.optional:
                raise InvalidArgument("state_dict", f"tensor {name!r} is missing")
        return [name for name in self.shapes if name in present]

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if self.shapes is not None and tuple(shape) != self.shapes[name]:
            raise InvalidArgument(
                "state_dict",
                f"tensor {name!r} has shape {tuple(shape)}; the model expects {self.shapes[name]}",
            )


class AdapterSpec:
    """The LoRA adapters a model takes: the Linear modules they may adapt, (in, out)
    features by HF name (None = not known here: the engine that loads the adapter checks
    them), and the highest rank served (`max_rank`)."""

    def __init__(self, modules: Mapping[str, tuple[int, int]] | None, max_rank: int) -> None:
        self.modules = dict(modules) if modules is not None else None
        self.max_rank = max_rank

    def check(self, adapter: Mapping[str, torch.Tensor]) -> None:
        """Validate wire adapter tensors (`scalerl.policy.lora`): A and B of each module,
        a module the model has, A [r, in] and B [out, r] with its features, 1 <= r <=
        max_rank, floating-point and finite. Raises InvalidArgument("state_dict", ...)
        naming the first bad tensor."""
        try:
            shapes = adapter_shapes(adapter)
        except ValueError as exc:
            raise InvalidArgument("state_dict", str(exc)) from exc
        for module, shape in shapes.items():
            if not 1 <= shape.rank <= self.max_rank:
                raise InvalidArgument(
                    "state_dict",
                    f"tensor {module + LORA_A!r} has rank {shape.rank}; this engine serves "
                    f"ranks 1..{self.max_rank} (max_lora_rank)",
                )
            if self.modules is None:
                continue
            if module not in self.modules:
                raise InvalidArgument(
                    "state_dict",
                    f"tensor {module + LORA_A!r}: the model has no Linear {module!r} to adapt",
                )
            fan_in, fan_out = self.modules[module]
            if (shape.in_features, shape.out_features) != (fan_in, fan_out):
                raise InvalidArgument(
                    "state_dict",
                    f"tensor {module + LORA_A!r}: adapter of {shape.in_features} -> "
                    f"{shape.out_features} features; the module has {fan_in} -> {fan_out}",
                )
        for name, tensor in adapter.items():
            if not tensor.is_floating_point():
                raise _bad_dtype(name, tensor.dtype)
            if not bool(torch.isfinite(tensor).all()):
                raise _non_finite(name)


def check_adapter_base(base_version: int | None, serving: int | None) -> None:
    """An adapter alone applies only to the base it names: raise
    InvalidArgument("base_version") unless `base_version` is the engine's (`serving`: the
    newest base serving or staged), so a new label never lands on another base."""
    if base_version != serving:
        raise InvalidArgument(
            "base_version",
            f"the adapter applies to base version {base_version}; this engine serves base "
            f"{serving} (load that base first)",
        )


def parse_payload(state_dict: Mapping[str, torch.Tensor]) -> Payload:
    """`scalerl.policy.lora.split_payload`, its ValueError raised as
    InvalidArgument("state_dict", ...)."""
    try:
        return split_payload(state_dict)
    except ValueError as exc:
        raise InvalidArgument("state_dict", str(exc)) from exc


def _bad_dtype(name: str, dtype: object) -> InvalidArgument:
    return InvalidArgument(
        "state_dict", f"tensor {name!r} has dtype {dtype}; a floating-point dtype is required"
    )


def _non_finite(name: str) -> InvalidArgument:
    return InvalidArgument("state_dict", f"tensor {name!r} holds NaN or infinite values")


def _not_safetensors(path: Path, exc: BaseException) -> InvalidArgument:
    return InvalidArgument("payload", f"{path} is not a valid safetensors file: {exc}")
