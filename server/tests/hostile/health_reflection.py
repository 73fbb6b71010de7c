"""An independent gRPC client checking what grpc_health_probe and grpcurl rely on.

Usage: health_reflection.py ADDR TOKEN

Speaks to a running gradsync-server with grpcio's own health and reflection stubs
(grpcio-health-checking, grpcio-reflection) and prints one JSON line per check:
{"case": ..., "ok": true|false, "detail": ...}. Then it shuts the server down through the
Shutdown RPC while a Health/Watch stream is open, and reports what the watch saw.
"""

import json
import sys

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

PS = "gradsync.ps.v1.ParameterServer"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT = 10


def report(case, ok, detail=""):
    print(json.dumps({"case": case, "ok": bool(ok), "detail": str(detail)}), flush=True)


def check(health, case, service, want):
    """Health/Check, as `grpc_health_probe -service=SERVICE` does."""
    try:
        r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        got = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except grpc.RpcError as e:
        got = e.code().name
    report(case, got == want, f"{got}, expected {want}")


def reflection_v1(channel):
    """`grpcurl list` over grpc.reflection.v1 (same messages as v1alpha, another package)."""
    info = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    replies = list(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT))
    return sorted(s.name for r in replies for s in r.list_services_response.service)


def main():
    addr, token = sys.argv[1], sys.argv[2]
    channel = grpc.insecure_channel(addr)
    grpc.channel_ready_future(channel).result(timeout=TIMEOUT)
    health = health_pb2_grpc.HealthStub(channel)

    # grpc_health_probe -addr=ADDR (overall) and -service=NAME; no token needed.
    check(health, "health_overall", "", "SERVING")
    check(health, "health_ps", PS, "SERVING")
    check(health, "health_unknown_service", "no.such.Service", "NOT_FOUND")

    # grpcurl -plaintext ADDR list, through v1alpha (older grpcurl) and v1; each version lists
    # the services and itself.
    db = ProtoReflectionDescriptorDatabase(channel)
    for version, list_services in [("v1alpha", db.get_services), ("v1", lambda: reflection_v1(channel))]:
        need = [PS, "grpc.health.v1.Health", f"grpc.reflection.{version}.ServerReflection"]
        try:
            listed = sorted(list_services())
            report(f"reflection_list_{version}", all(s in listed for s in need), listed)
        except grpc.RpcError as e:
            report(f"reflection_list_{version}", False, e.code().name)

    # grpcurl describe: the service's methods and a message's fields, from the descriptors the
    # server sends.
    try:
        pool = DescriptorPool(db)
        svc = pool.FindServiceByName(PS)
        methods = sorted(m.name for m in svc.methods)
        need = ["Deregister", "GetVersion", "Heartbeat", "PullParameters", "PushGradients",
                "Register", "Shutdown"]
        report("reflection_describe_service", methods == need, methods)
        chunk = pool.FindMessageTypeByName("gradsync.ps.v1.GradientChunk")
        fields = {f.name: f.type for f in chunk.fields}
        report("reflection_describe_message",
               fields.get("data") == descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
               and "offset" in fields, fields)
    except (grpc.RpcError, KeyError) as e:
        report("reflection_describe_service", False, e)
        report("reflection_describe_message", False, e)

    # Health/Watch sees SERVING, then NOT_SERVING once the server begins shutting down.
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
    first = next(watch)
    report("watch_serving", first.status == SERVING,
           health_pb2.HealthCheckResponse.ServingStatus.Name(first.status))
    ps_shutdown = channel.unary_unary(
        f"/{PS}/Shutdown", request_serializer=lambda _: b"", response_deserializer=lambda b: b)
    ps_shutdown(None, metadata=[("authorization", f"Bearer {token}")], timeout=TIMEOUT)
    try:
        second = next(watch)
        got = health_pb2.HealthCheckResponse.ServingStatus.Name(second.status)
        report("watch_not_serving_on_shutdown", second.status == NOT_SERVING, got)
    except grpc.RpcError as e:
        report("watch_not_serving_on_shutdown", False, e.code().name)
    watch.cancel()
    channel.close()


if __name__ == "__main__":
    main()
