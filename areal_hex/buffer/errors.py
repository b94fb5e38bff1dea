"""What a buffer call raises when the buffer's server is gone or failing, so that its
users (the controller, the trainer's source) catch the buffer's errors without knowing
which client library the buffer is written with."""

from __future__ import annotations

import redis.exceptions

# Any failure of a buffer call that is not a programming error: the server refused or
# failed the command, or the connection broke.
BUFFER_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)


def is_connection_error(exc: BaseException) -> bool:
    """Lost connection to the buffer (worth retrying): OS-level, or the client's own
    connection and timeout errors. A `TimeoutError` that is not the client's is the
    gate's "waited too long", not a lost connection."""
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return True
    if isinstance(exc, TimeoutError):
        return False
    return isinstance(exc, (ConnectionError, OSError))
