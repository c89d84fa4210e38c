"""marlaas/chat.py against a real HTTP server that answers as a failing rollout replica might:
every failure is a ChatFailed with a status the tenant API can pass on, never a traceback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from marlaas.chat import ChatFailed, chat_request

ANSWERS = {
    "/plain/chat/completions": (413, b"request entity too large"),
    "/refused/chat/completions": (401, b'{"error": {"message": "the internal credential"}}'),
    "/garbled/chat/completions": (200, b"<html>not json</html>"),
    "/empty/chat/completions": (200, b'{"choices": []}'),
    "/openai/chat/completions": (400, b'{"error": {"message": "n: only 1"}}'),
}


class Replica(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = ANSWERS[self.path]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return None


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize(
    ("where", "status", "says"),
    [
        ("plain", 413, "j: Request Entity Too Large"),
        ("refused", 502, "refused the internal credential"),
        ("garbled", 502, "j: Expecting value"),
        ("empty", 502, "answered no choices"),
        ("openai", 400, "j: n: only 1"),
    ],
)
def test_every_failure_of_the_replica_is_a_chat_failure(
    url: str, where: str, status: int, says: str
) -> None:
    with pytest.raises(ChatFailed) as failed:
        chat_request(f"{url}/{where}", {"model": "j"}, token="t")
    assert failed.value.status == status and says in str(failed.value)
