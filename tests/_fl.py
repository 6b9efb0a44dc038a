"""Helpers of the federated tests: Flower messages and contexts built by hand, as the engines build them."""

from __future__ import annotations

import time
from typing import Any


def train_message(arrays: Any, server_round: int = 1, node_id: int = 5, message_type: str = "train") -> Any:
    from flwr.app import ConfigRecord, Message, Metadata, RecordDict

    md = Metadata(run_id=1, message_id=f"msg-{server_round}", src_node_id=0, dst_node_id=node_id,
                  reply_to_message_id="", group_id=str(server_round), created_at=time.time(), ttl=3600.0,
                  message_type=message_type)
    return Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})}),
                   metadata=md)


def reply_message(content: Any, node_id: int) -> Any:
    """A reply as the server receives it (content from a client on ``node_id``)."""
    from flwr.app import Message, Metadata

    md = Metadata(run_id=1, message_id=f"reply-{node_id}", src_node_id=node_id, dst_node_id=0,
                  reply_to_message_id="x", group_id="1", created_at=time.time(), ttl=3600.0, message_type="train")
    return Message(content=content, metadata=md)


def context(node_config: dict[str, Any], run_config: dict[str, Any] | None = None, node_id: int = 5) -> Any:
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=node_id, node_config=dict(node_config), state=RecordDict(),
                   run_config=dict(run_config or {}))


def train_partitions(app: Any, arrays: Any, partitions: int, budget: str) -> list[Any]:
    """``app``'s reply to one train message per partition of ``partitions``, each within ``budget``; every reply
    is checked to carry no error."""
    replies = []
    for pid in range(partitions):
        reply = app(train_message(arrays), context({"partition-id": pid, "num-partitions": partitions,
                                                    "memory-budget": budget}))
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        replies.append(reply)
    return replies
