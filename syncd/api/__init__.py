"""The gRPC contract (stubs generated from proto/weightsync/v1/syncd.proto) and its conversions."""

# Catalogs and plan parts of large MoE models exceed gRPC's 4 MiB default; syncd and clients use these.
MESSAGE_SIZE_OPTIONS = (
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
)
