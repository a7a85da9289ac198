"""The ZeroMQ bus: message schema, state mirroring, device services, clients, supervision and
CurveZMQ security with keys bound to roles. docs/bus.md describes every socket, topic and
message."""
