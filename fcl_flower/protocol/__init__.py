"""The message protocol between the server (``strategies/``) and the clients (``clients/``).

:mod:`.messages` defines the training, statistics and info messages, :mod:`.secure` the messages
of a secure statistics round, :mod:`.base` what they share (header, bases, checked readers),
:mod:`.payloads` the arrays each method uploads, :mod:`.arrays` the checked NumPy array <-> record
conversion (no torch: :mod:`fcl_flower.tensors` converts for the handlers that compute with it), :mod:`.errors` the one-line errors. Both sides use only these types.
"""

from fcl_flower.methods import Kind
from fcl_flower.protocol.arrays import (
    WIRE_DTYPES,
    cast_for_wire,
    from_record,
    message_bytes,
    payload_bytes,
    read_array,
    read_ring,
    to_record,
)
from fcl_flower.protocol.base import Header, Instruction, Reply
from fcl_flower.protocol.errors import ProtocolError, UploadError
from fcl_flower.protocol.messages import (
    Backfill,
    EvaluateIns,
    EvaluateRes,
    EvaluationRequest,
    FedranReport,
    InfoIns,
    InfoRes,
    LGAReport,
    StampReport,
    StatsIns,
    StatsRes,
    TrainIns,
    TrainRes,
    parse_instruction,
    parse_reply,
)
from fcl_flower.protocol.secure import (
    DealtShares,
    KeysIns,
    KeysRes,
    MaskedReport,
    PublicKeys,
    SecAggRound,
    SharesAhead,
    SharesIns,
    SharesRes,
    UnmaskIns,
    UnmaskRes,
)

__all__ = [
    "WIRE_DTYPES",
    "Backfill",
    "DealtShares",
    "EvaluateIns",
    "EvaluateRes",
    "EvaluationRequest",
    "FedranReport",
    "Header",
    "InfoIns",
    "InfoRes",
    "Instruction",
    "KeysIns",
    "KeysRes",
    "Kind",
    "LGAReport",
    "MaskedReport",
    "ProtocolError",
    "PublicKeys",
    "Reply",
    "SecAggRound",
    "SharesAhead",
    "SharesIns",
    "SharesRes",
    "StampReport",
    "StatsIns",
    "StatsRes",
    "TrainIns",
    "TrainRes",
    "UnmaskIns",
    "UnmaskRes",
    "UploadError",
    "cast_for_wire",
    "from_record",
    "message_bytes",
    "parse_instruction",
    "parse_reply",
    "payload_bytes",
    "read_array",
    "read_ring",
    "to_record",
]
