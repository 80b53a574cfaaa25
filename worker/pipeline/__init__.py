"""Pipeline parallelism: one process per stage, micro-batches streamed over torch.distributed.

Stage 0 (the driver) owns scheduling, the block manager and request intake; it sends each
micro-batch downstream as a fixed-size header, one packed int64 payload and the hidden states.
The last stage samples and returns token ids to stage 0. See `protocol.py` for the wire format.
"""
