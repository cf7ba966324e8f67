"""Where odl's files live: local paths and ``oss://bucket/key`` behind one API.

``file_store`` is the API every reader and writer of a file uses; ``storage_path`` parses and
joins paths of both kinds; ``oss_credentials`` finds the OSS credentials; ``oss_store`` talks
to OSS through ``oss2`` with retries, backoff and health counters.
"""
