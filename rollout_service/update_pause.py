"""What a weight update does to the requests in flight (`rollout.update_pause`).

- abort (SGLang's way): they end with their partial output and the controller resends
  them; each token is tagged with the version of the response that returned it.
- retract: the servers keep them, recompute their KV cache with the new weights and go
  on; only correct when the servers report each token's version
  (`meta_info.output_token_versions`, advertised in `/get_server_info`).
- auto: retract when every server advertises per-token versions, else abort.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


async def reports_token_versions(client: Any) -> bool:
    """Whether the server behind `client` tags each output token with its version."""
    info = getattr(client, "server_info", None)
    if info is None:
        return False
    try:
        return bool((await info()).get("output_token_versions"))
    except Exception:  # unreachable now: treat it as one that does not
        return False


async def resolve_pause_mode(mode: str, clients: Sequence[Any]) -> str:
    """The mode to use for `rollout.update_pause=mode` with these servers."""
    if mode == "abort":
        return mode
    ok = await asyncio.gather(*[reports_token_versions(c) for c in clients])
    if all(ok):
        mode = "retract"
    elif mode == "retract":
        log.warning(
            "rollout.update_pause=retract, but %d server(s) do not report per-token "
            "versions: their tokens are tagged with the version of each response",
            ok.count(False),
        )
    else:
        mode = "abort"
    log.info("weight updates: %s in-flight requests", mode)
    return mode
