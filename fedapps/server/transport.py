"""``strategy.transport``: the drafts of a round told how their model arrays travel (their request's
``arrays.transport``; the arrays are encoded that way when the message is built, :func:`fedapps.wire.message.
build_messages`), and so the clients told to reply in kind."""

from __future__ import annotations

import dataclasses

from fedapps.wire import protocol
from fedapps.wire.protocol import Draft


def with_transport(drafts: list[Draft], transport: str) -> list[Draft]:
    """``transport`` applied to drafts as the strategy made them: where arrays go out (``arrays``, ``eval_arrays``)
    or are asked back, the request says ``arrays.transport`` (the arrays are then encoded for it, once, when the
    message is built; the client replies in kind). float32: the drafts untouched. Drafts that shared a request share
    the changed one."""
    protocol.check_transport(transport)
    if transport == "float32":
        return drafts
    changed: dict[int, tuple[protocol.Request, protocol.Request]] = {}
    for draft in drafts:
        request = draft.request
        if draft.arrays is None and draft.eval_arrays is None and not request.returns.arrays:
            continue
        found = changed.get(id(request))
        if found is None or found[0] is not request:
            found = changed[id(request)] = (request, dataclasses.replace(request, transport=transport))
        draft.request = found[1]
    return drafts
