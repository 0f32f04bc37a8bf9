"""`python -m scalerl.rpc.probe ADDRESS [--service NAME] [--tls-ca F --tls-cert F
--tls-key F --server-name N]`: a gRPC health check for Kubernetes exec probes where the
port speaks TLS (the kubelet's own gRPC probe speaks plaintext only). Exit 0 when the
service is SERVING, 1 otherwise (one line saying why), 2 on bad usage."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scalerl.config import SecurityConfig
from scalerl.rpc.channel import channel
from scalerl.rpc.security import from_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scalerl.rpc.probe")
    parser.add_argument("address", help="host:port")
    parser.add_argument("--service", default="", help="Health service name ('' = the server).")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    for flag in ("--tls-ca", "--tls-cert", "--tls-key", "--server-name"):
        parser.add_argument(flag, default="")
    args = parser.parse_args(argv)
    try:
        section = SecurityConfig(
            tls_ca_file=args.tls_ca,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            tls_server_name=args.server_name,
        )
        security = from_config(section, environ={})  # health needs no token
    except ValueError as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 2
    with channel(args.address, security) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as exc:
            print(f"probe: {args.address}: {exc.code().name} {exc.details()}", file=sys.stderr)
            return 1
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"probe: {args.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
