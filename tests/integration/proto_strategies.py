"""Hypothesis strategies for arbitrary protobuf messages, read off their descriptors: every
field may be set or left out, numbers reach their type's extremes (NaN and infinities for
floats), enums take unknown numbers too, strings are any unicode, repeated fields hold a
few values; plausible values (rewards in [0, 1], run names, sha256 digests) are drawn
often enough that requests also get past the first check. Used to fuzz the services' RPCs."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_T = FieldDescriptor
_INTS = {
    _T.TYPE_INT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _T.TYPE_INT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _T.TYPE_UINT32: (0, 2**32 - 1),
    _T.TYPE_FIXED32: (0, 2**32 - 1),
    _T.TYPE_UINT64: (0, 2**64 - 1),
    _T.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Small values (the ones validation cares about) as often as the extremes."""
    small = st.integers(max(low, -3), min(high, 300))
    return st.one_of(small, st.sampled_from([low, high]), st.integers(low, high))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INTS:
        return _integers(*_INTS[field.type])
    if field.type in (_T.TYPE_DOUBLE, _T.TYPE_FLOAT):
        width = 32 if field.type == _T.TYPE_FLOAT else 64
        plausible = st.one_of(st.floats(0.0, 1.0, width=width), st.floats(0.0, 1e4, width=width))
        return st.one_of(plausible, plausible, st.floats(width=width))
    if field.type == _T.TYPE_BOOL:
        return st.booleans()
    if field.type == _T.TYPE_STRING:
        # Valid-looking names and digests too, so requests get past the first check.
        names = st.sampled_from(["", "r1", "run-a", "policy-v1.safetensors"])
        hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
        return st.one_of(names, hex64, st.text(max_size=24))
    if field.type == _T.TYPE_BYTES:
        return st.binary(max_size=96)
    if field.type == _T.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 99))
    raise TypeError(f"field {field.full_name}: unsupported type {field.type}")


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    if field.type == _T.TYPE_MESSAGE:
        if field.message_type.GetOptions().map_entry or depth <= 0:
            return None
        value = messages(field.message_type, depth - 1)
    else:
        value = _scalar(field)
    return st.lists(value, max_size=8) if field.is_repeated else value


def messages(descriptor: Descriptor, depth: int = 3) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type with any subset of fields set (nested `depth` deep)."""
    optional = {}
    for field in descriptor.fields:
        strategy = _field(field, depth)
        if strategy is not None:
            optional[field.name] = strategy
    cls = _message_class(descriptor)
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: _build(cls, values))


def near(base: Message, depth: int = 2) -> st.SearchStrategy[Message]:
    """Copies of a valid `base` with up to two fields replaced by arbitrary values, and
    (recursively) its nested messages mutated the same way: requests that get past the
    first checks and probe the later ones."""
    descriptor = base.DESCRIPTOR
    fields = {f.name: _field(f, depth) for f in descriptor.fields}
    names = sorted(name for name, strategy in fields.items() if strategy is not None)

    @st.composite
    def mutate(draw: st.DrawFn) -> Message:
        message = type(base)()
        message.CopyFrom(base)
        for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
            message.ClearField(name)
            _assign(message, name, draw(fields[name]))
        for field in descriptor.fields:
            if field.type != _T.TYPE_MESSAGE or depth <= 0 or not draw(st.booleans()):
                continue
            if field.message_type.GetOptions().map_entry:
                continue
            items = getattr(message, field.name)
            if field.is_repeated and len(items):
                item = items[draw(st.integers(0, len(items) - 1))]
                item.CopyFrom(draw(near(item, depth - 1)))
            elif not field.is_repeated and message.HasField(field.name):
                items.CopyFrom(draw(near(items, depth - 1)))
        return message

    return mutate()


def _message_class(descriptor: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _build(cls: type[Message], values: dict[str, Any]) -> Message:
    message = cls()
    for name, value in values.items():
        _assign(message, name, value)
    return message


def _assign(message: Message, name: str, value: Any) -> None:
    field = message.DESCRIPTOR.fields_by_name[name]
    target = getattr(message, name)
    if field.is_repeated:
        if field.type == _T.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == _T.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, name, value)
