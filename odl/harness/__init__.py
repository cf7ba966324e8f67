"""Test and benchmark harness, shared by ``tests/`` and ``bench/``; not used by production code.

It holds what both need: real broker topics and records (``topic_records``), the HTTP client
for the status and prediction endpoints (``http_client``), real trainer processes
(``trainer_process``, ``trainer_killer``), the delta-topic and exactly-once audits
(``delta_topic_audit``, ``exactly_once_audit``), the backlog drain (``backlog_drain``) and
the loopback test doubles of the cloud services, OSS (``oss_double``) and DataHub
(``datahub_double``), on one server base (``loopback_server``).
``tests/`` and ``bench/`` never import each other, and production code never imports this
package; the import-linter contracts in ``pyproject.toml`` enforce both.
"""
