"""Silence the messages of our dependencies that a user of this app cannot act on (and nothing else).

* Ray's FutureWarning "Tip: In future versions of Ray, Ray will no longer override accelerator
  visible devices env var if num_gpus=0": this app relies on today's behaviour (a simulated client
  without a GPU share sees no GPU, see docs/simulation.md, "GPUs"), and Ray's default keeps it.
* Flower's "Manually terminating ClientAppActor" when the simulation shuts its Ray actors down: a
  normal shutdown, logged as a warning by every actor.
* Flower's DEPRECATED FEATURE notice for ``run_simulation`` in experiments/sim.py: Flower 1.41 has
  no supported Python launcher (docs/simulation.md explains; ``flwr run`` is the supported path).
* Flower's traceback of a :class:`OneLineError` (a ServerApp that ends the run on a configuration
  or run error it has already logged in one line) and the ``Exit Code: ...`` notice after it.
  Flower 1.41 ends a run ``finished:failed`` only when the ServerApp raises, and then logs the
  exception with its traceback (flwr/simulation/app.py and flwr/superlink/runtime/run_serverapp.py:
  ``log(ERROR, "%s raised an exception", exc_entity, exc_info=ex)``, then ``flwr_exit``); it has no
  call that fails a run quietly. The run still ends ``finished:failed``.

What cannot be silenced from here is documented in docs/getting_started.md ("Known messages").
"""

from __future__ import annotations

import logging
import warnings

_DROP = (
    "Manually terminating",
    "The `run_simulation` function is deprecated",
)


class OneLineError(RuntimeError):
    """An error whose one line is already logged: Flower's traceback of it is noise."""


class _LoggedError(logging.Filter):
    """Drops the record that carries a OneLineError (Flower's traceback of it) and the next
    ``Exit Code:`` notice of the same process."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, OneLineError):
            self.dropped = True
            return False
        if self.dropped and str(record.msg).startswith("Exit Code:"):
            self.dropped = False
            return False
        return True


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage() if record.args else str(record.msg)
        return not any(text in message for text in _DROP)


def quiet_known_noise() -> None:
    """Install the filters (idempotent); called when the ServerApp and ClientApp modules load."""
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
    logger = logging.getLogger("flwr")
    if not any(isinstance(f, _KnownNoise) for f in logger.filters):
        logger.addFilter(_KnownNoise())
    if not any(isinstance(f, _LoggedError) for f in logger.filters):
        logger.addFilter(_LoggedError())
