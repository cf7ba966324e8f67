"""Serving plugin: loads an export, replays the delta topic onto it, serves predictions.

Public API:

* ``serving_model.ServingModel`` (``load``, ``predict_values``, ``predict_batch``,
  ``apply_version``);
* ``export_reader`` (``read_export``, ``find_latest_export``, ``read_kafka_txt``);
* ``delta_replayer.DeltaReplayer`` (``handle`` one message, ``start`` / ``stop`` the topic
  thread, ``wait_for_offset``);
* ``serving_service.ServingService`` (model + replayer + FastAPI app; ``start`` / ``stop``);
  ``odl-serve`` (``odl/cli/serve_cli.py``) runs one.

Imports no trainer code that needs a consumer group, an optimizer or DMP.
"""
