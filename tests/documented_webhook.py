"""The receiver-side verification snippet of docs/webhooks.md, run exactly as documented.

Test receivers verify vigil's deliveries with it, so a change to the signing scheme that the
documentation does not follow fails the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "webhooks.md"


def _load() -> tuple[Callable[..., str], type[Exception]]:
    section = DOC.read_text().split("## Verifying a delivery", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"__name__": "vigil_webhook_receiver"}
    exec(compile(code, str(DOC), "exec"), namespace)  # our own documentation's code, run as written
    return namespace["verify_webhook"], namespace["WebhookRefused"]


verify_webhook, WebhookRefused = _load()
