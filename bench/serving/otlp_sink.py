"""An OTLP/HTTP endpoint that accepts trace exports and throws them away, counting them: for measuring what
tracing costs the services that export, without a collector's own work on the same cores.

usage: python -m bench.serving.otlp_sink --port 4318   (prints exports and bytes received when stopped)
"""

from __future__ import annotations

import argparse
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink(BaseHTTPRequestHandler):
    exports = 0
    received_bytes = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        Sink.exports += 1
        Sink.received_bytes += length
        # an empty ExportTraceServiceResponse encodes to no bytes: "all spans accepted"
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _stop(*_signal_args) -> None:
    raise SystemExit(0)  # unwinds serve_forever; the count is printed on the way out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Sink)
    signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        print(f"otlp sink: {Sink.exports} exports, {Sink.received_bytes} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
