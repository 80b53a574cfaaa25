"""Protobuf packages generated from `proto/chariot/*` (`make proto`)."""
