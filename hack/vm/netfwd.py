#!/usr/bin/python3
"""The two host-side links of the guest cluster (hack/vm/helm-test.sh).

  netfwd.py pipe HOST PORT
      qemu's guestfwd runs this once per guest connection (stdin/stdout are
      the connection) and splices it to HOST:PORT: the guest's kubelet
      reaches the API server on the host at 10.0.2.100:6443.
  netfwd.py connect-proxy SOCKET PORT:HOSTPORT...
      an HTTP CONNECT proxy on a unix socket, the API server's egress
      selector for the "cluster" egress: a CONNECT to any address on PORT
      is spliced to 127.0.0.1:HOSTPORT, the port qemu forwards to the
      guest's PORT (kubelet's 10250: logs, exec, port-forward). Other ports
      are refused.
"""
import os
import selectors
import socket
import sys
import threading


def splice(a_in, a_out, b):
    """Copy a_in -> b and b -> a_out until either side closes."""
    sel = selectors.DefaultSelector()
    sel.register(a_in, selectors.EVENT_READ, "a")
    sel.register(b, selectors.EVENT_READ, "b")
    open_ends = 2
    while open_ends:
        for key, _ in sel.select():
            if key.data == "a":
                data = os.read(a_in.fileno() if hasattr(a_in, "fileno") else a_in, 65536)
                if not data:
                    sel.unregister(a_in)
                    open_ends -= 1
                    try:
                        b.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    continue
                b.sendall(data)
            else:
                data = b.recv(65536)
                if not data:
                    return
                if isinstance(a_out, socket.socket):
                    a_out.sendall(data)
                else:
                    os.write(a_out, data)


def pipe(host, port):
    b = socket.create_connection((host, int(port)))
    splice(sys.stdin, sys.stdout.fileno(), b)


def serve_connect(conn, ports):
    try:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                return
            head += chunk
        line = head.split(b"\r\n", 1)[0].decode()
        method, target, _ = line.split(" ", 2)
        port = target.rsplit(":", 1)[1]
        if method != "CONNECT" or port not in ports:
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\n\r\n")
            return
        up = socket.create_connection(("127.0.0.1", int(ports[port])), timeout=10)
        up.settimeout(None)
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        rest = head.split(b"\r\n\r\n", 1)[1]
        if rest:
            up.sendall(rest)
        splice(conn, conn, up)
    except (OSError, ValueError, IndexError) as e:
        print(f"netfwd: {e}", file=sys.stderr, flush=True)
    finally:
        conn.close()


def connect_proxy(path, mappings):
    ports = dict(m.split(":", 1) for m in mappings)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve_connect, args=(conn, ports), daemon=True).start()


if __name__ == "__main__":
    if sys.argv[1] == "pipe":
        pipe(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "connect-proxy":
        connect_proxy(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
