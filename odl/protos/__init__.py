"""Generated protobuf code (``make protos`` writes ``*_pb2.py`` here from ``protos/``)."""
