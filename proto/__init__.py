"""Wire API: `.proto` sources under `proto/chariot/v1/` and their generated Python (`make proto`).

Import the generated modules as `chariot.proto.chariot.v1.generation_pb2(_grpc)`.
"""
