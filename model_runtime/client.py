"""A small client for the runtime's gRPC service (used by ``model-runtime complete
--server``, the demo, tools and tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from kvcache.auth import ClientAuth
from kvcache.config import normalize_address

from .v1 import runtime_pb2 as pb
from .v1 import runtime_pb2_grpc as pb_grpc


class RuntimeClient:
    def __init__(self, address: str, timeout: float | None = 300.0,
                 auth: ClientAuth | None = None) -> None:
        """``timeout`` bounds each call in seconds (None: no deadline)."""
        self.address = normalize_address(address)
        self.timeout = timeout
        self.channel = (auth or ClientAuth()).channel(self.address, options=[])
        self.stub = pb_grpc.ModelRuntimeStub(self.channel)

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def complete(self, *, prompt: str | None = None, tokens: Sequence[int] | None = None,
                 messages: Sequence[dict[str, str]] | None = None,
                 timeout: float | None = None, **options: Any) -> dict[str, Any]:
        """One completion; returns the final record as a dict (text pieces are joined)."""
        done = self.complete_message(prompt=prompt, tokens=tokens, messages=messages,
                                     timeout=timeout, **options)
        return MessageToDict(done, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    def complete_message(self, *, prompt: str | None = None,
                         tokens: Sequence[int] | None = None,
                         messages: Sequence[dict[str, str]] | None = None,
                         timeout: float | None = None, **options: Any) -> pb.Completion:
        """One completion's final record. Raises ``grpc.RpcError`` as the service answers
        (``INVALID_ARGUMENT`` for a bad request, ``UNAVAILABLE`` when nothing serves)."""
        request = pb.CompleteRequest(**options)
        if prompt is not None:
            request.prompt = prompt
        elif tokens is not None:
            request.tokens.ids.extend(tokens)
        elif messages is not None:
            request.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
        done = pb.Completion()
        for event in self.stub.Complete(request, timeout=timeout or self.timeout):
            if event.HasField("done"):
                done = event.done
        return done

    def stats(self) -> dict[str, Any]:
        return MessageToDict(self.stub.Stats(pb.RuntimeStatsRequest(), timeout=10),
                             preserving_proto_field_name=True)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RuntimeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
