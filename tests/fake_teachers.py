"""Fake teacher servers on 127.0.0.1 for the served teacher's tests and the sft_data flow's: a canned
OpenAI-compatible completions server (:class:`FakeServer`, the ``server`` fixture) and a raw one whose handler
answers as a test writes it (:class:`RawServer`)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeServer:
    """A canned OpenAI-compatible completions server on 127.0.0.1 (one thread per request)."""

    def __init__(self):
        self.requests: list[dict] = []  # {"path", "headers", "body"}
        self.script: list[tuple[int, object]] = []  # (status, reply) served in order, then echo replies
        self.delay_s = 0.0
        self.answer = "4"  # what echo replies answer
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                time.sleep(server.delay_s)
                status, reply = server.script.pop(0) if server.script else (200, server.echo(body))
                data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def echo(self, body):
        """Choices in reverse index order; text names prompt and sample; vLLM's stop_reason set, stop string cut."""
        prompts, n = body["prompt"], body["n"]
        choices = [
            {
                "index": i * n + j,
                "text": f" {p[-12:]} #{j} </think> <answer> {self.answer} ",
                "finish_reason": "stop",
                "stop_reason": "</answer>",
            }
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        return {"object": "text_completion", "choices": choices[::-1]}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class RawServer:
    """A server on 127.0.0.1 whose ``reply(handler)`` writes each response by hand; records every request's
    method, path and headers (GETs too: a redirected POST may arrive as one)."""

    def __init__(self, reply):
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})
                try:
                    reply(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_GET = do_POST

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def redirect(status: int, location: str):
    def reply(handler):
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return reply


def send(handler, data: bytes, length: bool = True):
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    if length:
        handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
