"""A hostile gRPC client for gradsync-server, independent of the Rust code: stubs are generated
from proto/proto/*.proto by grpcio-tools at test time.

Usage: hostile_client.py STUBS_DIR ADDR TOKEN FINGERPRINT PARAMS_OUT

Prints one JSON object per case, {"case": NAME, "code": GRPC_CODE_NAME, "detail": TEXT}, and
writes the parameters pulled after every case to PARAMS_OUT (raw little-endian f32). What each
case must get is decided by the driving Rust test, not here.
"""

import json
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, sys.argv[1])
import grpc  # noqa: E402
from gradsync.ps.v1 import ps_pb2 as pb  # noqa: E402
from gradsync.ps.v1 import ps_pb2_grpc as pbg  # noqa: E402

ADDR, TOKEN, FINGERPRINT, PARAMS_OUT = sys.argv[2:6]
AUTH = [("authorization", "Bearer " + TOKEN)]
TIMEOUT = 20.0


def report(case, err=None, detail=""):
    code = "OK" if err is None else err.code().name
    detail = detail if err is None else (err.details() or "")
    print(json.dumps({"case": case, "code": code, "detail": detail[:300]}), flush=True)


def call(case, fn, *args, **kw):
    try:
        reply = fn(*args, timeout=TIMEOUT, **kw)
        report(case, None, str(reply).replace("\n", " ")[:200])
        return reply
    except grpc.RpcError as e:
        report(case, e)
        return None


def chunks(rank, base, parts):
    for offset, data in parts:
        yield pb.GradientChunk(rank=rank, base_version=base, offset=offset, data=data)


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def pull(stub):
    out = bytearray()
    for c in stub.PullParameters(pb.PullRequest(rank=0), timeout=TIMEOUT, metadata=AUTH):
        if c.offset * 4 != len(out):
            raise SystemExit("pull: chunk at offset %d after %d bytes" % (c.offset, len(out)))
        out += c.data
    return bytes(out)


def flood(case, count, fn):
    """Run fn(i) for i < count on as many threads at once; report the set of codes seen."""
    codes = {}
    lock = threading.Lock()

    def one(i):
        try:
            fn(i)
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        with lock:
            codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"case": case, "code": "|".join(sorted(codes)), "detail": json.dumps(codes)}), flush=True)


def main():
    chan = grpc.insecure_channel(ADDR, options=[("grpc.max_send_message_length", 64 << 20)])
    stub = pbg.ParameterServerStub(chan)
    before = pull(stub)
    n = len(before) // 4

    # Authentication.
    call("no_token", stub.GetVersion, pb.VersionRequest())
    call("wrong_token", stub.GetVersion, pb.VersionRequest(), metadata=[("authorization", "Bearer nope")])
    call("not_bearer", stub.GetVersion, pb.VersionRequest(), metadata=[("authorization", TOKEN)])

    # Registration.
    reg = lambda rank, world, fp=FINGERPRINT: stub.Register(  # noqa: E731
        pb.RegisterRequest(rank=rank, world_size=world, fingerprint=fp), timeout=TIMEOUT, metadata=AUTH)
    call("wrong_fingerprint", lambda **kw: reg(0, 2, "mlp:1-2:f32:seed=0"))
    call("absurd_world", lambda **kw: reg(0, 0xFFFFFFFF))
    call("zero_world", lambda **kw: reg(0, 0))
    call("rank_not_below_world", lambda **kw: reg(7, 2))
    call("push_unregistered", stub.PushGradients, chunks(1, 0, [(0, f32([0.0] * n))]), metadata=AUTH)
    call("register", lambda **kw: reg(0, 2))
    # A flood of registrations, concurrent: every one refused, the membership unchanged.
    flood("registration_flood", 400, lambda i: reg(0, 2) if i % 2 == 0 else reg(1, 3))

    # Gradient streams from the registered rank 0, each malformed.
    push = lambda case, parts, rank=0: call(  # noqa: E731
        case, stub.PushGradients, chunks(rank, 0, parts), metadata=AUTH)
    push("empty_stream", [])
    push("truncated_stream", [(0, f32([0.5] * (n // 2)))])
    push("absurd_offset", [(1 << 62, f32([1.0]))])
    push("max_offset", [(0xFFFFFFFFFFFFFFFF, f32([1.0]))])
    push("out_of_order", [(4, f32([1.0] * (n - 4))), (0, f32([1.0] * 4))])
    push("overlapping", [(0, f32([1.0] * 8)), (4, f32([1.0] * (n - 4)))])
    push("overrun", [(0, f32([1.0] * (n + 1)))])
    push("ragged_chunk", [(0, b"\x00" * 5)])
    push("nan_gradient", [(0, f32([float("nan")] + [0.0] * (n - 1)))])
    try:
        stub.PushGradients(iter([pb.GradientChunk(rank=0, base_version=0, offset=0, data=f32([0.0] * 4)),
                                 pb.GradientChunk(rank=1, base_version=0, offset=4, data=f32([0.0] * (n - 4)))]),
                           timeout=TIMEOUT, metadata=AUTH)
        report("rank_changes_midstream", None)
    except grpc.RpcError as e:
        report("rank_changes_midstream", e)
    # A single message far above the server's limit: refused before it is buffered whole.
    push("oversized_message", [(0, b"\x00" * (48 << 20))])

    # A stalled stream: one chunk, then silence past the server's worker timeout.
    def stalled():
        yield pb.GradientChunk(rank=0, base_version=0, offset=0, data=f32([0.0] * 4))
        time.sleep(4.0)
    try:
        stub.PushGradients(stalled(), timeout=TIMEOUT, metadata=AUTH)
        report("stalled_stream", None)
    except grpc.RpcError as e:
        report("stalled_stream", e)

    # Many truncated streams at once.
    flood("truncated_flood", 64, lambda i: stub.PushGradients(
        chunks(0, 0, [(0, f32([0.0] * (n // 3)))]), timeout=TIMEOUT, metadata=AUTH))

    # Garbage bytes on the gRPC port.
    host, port = ADDR.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(b"\xff" * 4096 + b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 64)
    s.settimeout(10)
    try:
        while s.recv(65536):
            pass
        detail = "connection closed by the server"
    except (ConnectionResetError, socket.timeout) as e:
        detail = "connection ended: %s" % type(e).__name__
    s.close()
    report("garbage_bytes", None, detail)

    call("deregister", stub.Deregister, pb.DeregisterRequest(rank=0), metadata=AUTH)
    call("healthy_after", stub.GetVersion, pb.VersionRequest(), metadata=AUTH)
    after = pull(stub)
    print(json.dumps({"case": "params_unchanged", "code": "OK" if after == before else "CHANGED",
                      "detail": "%d values" % n}), flush=True)
    with open(PARAMS_OUT, "wb") as f:
        f.write(after)


if __name__ == "__main__":
    main()
