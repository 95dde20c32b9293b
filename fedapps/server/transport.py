"""``strategy.transport``: the model arrays of the messages a strategy built, re-encoded for the wire
(:func:`fedapps.wire.protocol.transport_record`), and the clients told to reply in kind."""

from __future__ import annotations

from flwr.app import ArrayRecord, Message

from fedapps.wire import protocol


def with_transport(messages: list[Message], transport: str) -> list[Message]:
    """``transport`` applied to messages as the strategy built them: their model arrays (``arrays``,
    ``eval-arrays``) re-encoded (:func:`protocol.encode_arrays`) and, where arrays go out or are asked back,
    ``arrays.transport`` set so that the client replies in kind. float32: the messages untouched. A record
    shared by several messages is encoded once."""
    if transport == "float32":
        return messages
    encoded: dict[int, ArrayRecord] = {}
    requests = protocol.RequestMemo()
    for msg in messages:
        request = requests.of(msg)
        names = [n for n in (protocol.ARRAYS, protocol.EVAL_ARRAYS) if n in msg.content]
        for name in names:
            record = msg.content.array_records[name]
            if id(record) not in encoded:
                encoded[id(record)] = protocol.transport_record(record, transport)
            msg.content[name] = encoded[id(record)]
        if names or request.returns.arrays:
            protocol.with_request(msg, requests.replaced(request, transport=transport))
    return messages
