"""The chat page `llmq serve` serves at `/`: static files in this package (static/, no build step, nothing from a
CDN) and the model card the page shows, `GET /card`.

The page is only markup and script; everything it shows of the model comes from the API behind the server's key:
`/card` (what artifacts/card.py says of the served artifact: quantization, KLD, gates) and `/v1/chat/completions`,
streamed. Served by the server itself it is same-origin, so BrowserGuard's Host and Origin checks pass it and its
JSON POSTs, and a cross-site page still cannot read or drive the API. The page and its files carry a
Content-Security-Policy that lets them load and connect to this origin only.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from ...artifacts import Artifact, ArtifactError, Store
from ...artifacts.card import card
from ...models.vision import runs_images
from .frontend import Frontend, artifact_ref
from .protocol import error_body

STATIC = Path(__file__).with_name("static")
FILES = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                      "img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                                      "frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def model_card(fe: Frontend) -> dict:
    """The served model's card: the artifact's (artifacts/card.py) when it is one in a store, else what the engine
    knows; and always the served name, architecture and context length."""
    eng = fe.engine
    out = {"ref": fe.name, "kind": None, "id": None, "model": None, "quantization": None, "kld": None, "gates": None}
    if artifact_ref(eng.path) is not None:
        try:
            out = card(Store(eng.path.parent.parent), Artifact.load(eng.path, verify=False))
        except ArtifactError:   # a damaged manifest or relative: the engine's own facts only
            pass
    return dict(out, served_name=fe.name, architecture=eng.spec.architecture, max_model_len=fe.max_model_len,
                kv_cache_dtype=str(eng.kv_cache_dtype), vision=runs_images(eng.spec.vision))


def add_page(app: FastAPI, fe: Frontend, auth) -> None:
    """Routes: `/` (the page), `/static/<file>` (its script and style), `/card` (behind `auth`, like the API)."""
    files = {name: (STATIC / name).read_bytes() for name in FILES}
    index = (STATIC / "index.html").read_bytes()
    the_card = model_card(fe)

    @app.get("/", include_in_schema=False)
    async def page():
        return Response(index, media_type="text/html; charset=utf-8", headers=HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in files:
            return JSONResponse(error_body(f"no static file {name[:100]!r}", code="not_found"), status_code=404)
        return Response(files[name], media_type=FILES[name], headers=HEADERS)

    @app.get("/card", dependencies=[Depends(auth)], include_in_schema=False)
    async def model():
        return the_card
