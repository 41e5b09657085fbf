"""The wire contracts, re-exported from the one generated package."""

from services.common.gen.libra.v1 import events_pb2 as ev
from services.common.gen.libra.v1 import weightsync_pb2 as ws
from services.common.gen.libra.v1 import weightsync_pb2_grpc as ws_grpc

MAX_TEMPERATURE = 10.0
"""Largest sampling temperature on the wire: engines refuse more, the trainer rejects segments with more."""

MAX_ALTERNATIVES = 7
"""Most further samples one turn may ask for beside it (TurnRequest.alternatives): engines refuse
more, so an agent's call takes `n` up to MAX_ALTERNATIVES + 1."""

__all__ = ["MAX_ALTERNATIVES", "MAX_TEMPERATURE", "ev", "ws", "ws_grpc"]
