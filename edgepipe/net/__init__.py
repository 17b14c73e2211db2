"""Wire protocol (msgpack header + raw tensor bytes) and the channels that carry it."""
