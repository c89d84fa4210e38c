"""`python -m api_svc`: the tenant API (what `marlaas api`, the stack and the image run).

`--check` builds the app and loads the base model's tokenizer (what episode samples are read
with), and exits 0 without connecting: what an image must be able to do.
"""

from __future__ import annotations

import asyncio
import sys

from api_svc.server import ApiSettings, create_app, serve
from common.files.models import resolve_tokenizer
from common.runtime.config import SharedSettings, load
from common.runtime.logs import setup_logging
from common.runtime.service import exit_code
from marlaas.episodes import load_decoder


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    settings = load(SharedSettings)
    setup_logging(settings.log_level, settings.log_format)
    api = load(ApiSettings)
    if "--check" in args:
        import uvicorn

        paths = sorted(create_app(settings).openapi()["paths"])
        tokenizer = resolve_tokenizer(
            settings.base_model, settings.cache_dir, settings.tokenizer_dir
        )
        load_decoder(tokenizer)
        print(
            f"tenant API start-up check passed: uvicorn {uvicorn.__version__}, {len(paths)} paths, "
            f"tokenizer {tokenizer}"
        )
        return 0
    settings.require_bus_key()
    try:
        asyncio.run(serve(settings, api))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(exit_code("api_svc", main))
