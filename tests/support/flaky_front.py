"""A registry front that fails the first GET of every blob with a 503 and passes everything
else through to the real registry: an upstream failing the request of whoever asks first (in a
storm, the leader). Every request is logged as one line: "<client ip> <method> <path> <status>".

usage: flaky_front.py <listen host:port> <registry host:port> <log file>
"""

import http.client
import http.server
import socketserver
import sys
import threading

LISTEN, REGISTRY, LOG = sys.argv[1], sys.argv[2], sys.argv[3]
FAILED = set()
LOCK = threading.Lock()
PASSED_HEADERS = ("Accept", "Range", "User-Agent")
RETURNED_HEADERS = (
    "Content-Type",
    "Content-Length",
    "Content-Range",
    "Docker-Content-Digest",
    "Docker-Distribution-Api-Version",
    "Accept-Ranges",
    "Etag",
    "Location",
)


def log(client, method, path, status):
    with LOCK, open(LOG, "a") as f:
        f.write(f"{client} {method} {path} {status}\n")


class Front(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_HEAD(self):
        self.forward()

    def do_GET(self):
        path = self.path.split("?")[0]
        if "/blobs/sha256:" in path:
            with LOCK:
                first = path not in FAILED
                FAILED.add(path)
            if first:
                log(self.client_address[0], "GET", path, 503)
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.forward()

    def forward(self):
        host, port = REGISTRY.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        headers = {h: self.headers[h] for h in PASSED_HEADERS if self.headers[h]}
        conn.request(self.command, self.path, headers=headers)
        resp = conn.getresponse()
        log(self.client_address[0], self.command, self.path.split("?")[0], resp.status)
        self.send_response(resp.status)
        for h in RETURNED_HEADERS:
            v = resp.getheader(h)
            if v is not None:
                self.send_header(h, v)
        self.end_headers()
        if self.command != "HEAD":
            while True:
                chunk = resp.read(256 * 1024)
                if not chunk:
                    break
                self.wfile.write(chunk)
        conn.close()

    def log_message(self, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


if __name__ == "__main__":
    host, port = LISTEN.rsplit(":", 1)
    Server((host, int(port)), Front).serve_forever()
