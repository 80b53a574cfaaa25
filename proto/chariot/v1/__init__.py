"""chariot.v1 wire API: generated protobuf and gRPC code (`make proto`), committed."""
