"""A real nginx (Debian package) in front of the gateway, configured the way people deploy it:
gzip on for event streams, default proxy buffering — slogate's X-Accel-Buffering: no must
switch buffering off per response."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.prometheus_server import free_port
from tests.support.servers import stop_process


@contextlib.contextmanager
def nginx_in_front_of(upstream: str) -> Iterator[str]:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(binary).exists(), "nginx is not installed (make test installs the Debian package)"
    tmp = Path(tempfile.mkdtemp(prefix="slogate-nginx-"))
    port = free_port()
    host_port = upstream.removeprefix("http://")
    (tmp / "nginx.conf").write_text(f"""
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  gzip on;
  gzip_types text/event-stream application/json;
  gzip_min_length 1;
  upstream slogate {{ server {host_port}; keepalive 16; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://slogate;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_read_timeout 3s;   # an idle 3 s kills the stream unless pings flow
    }}
  }}
}}
""")
    proc = subprocess.Popen([binary, "-c", str(tmp / "nginx.conf"), "-p", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        import socket

        for _ in range(200):
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode() if proc.stderr else "nginx died")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 5)
        shutil.rmtree(tmp, ignore_errors=True)
