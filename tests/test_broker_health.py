"""One rule for broker reachability and out-of-range positions (``odl.kafka.broker_health``)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from odl.kafka.broker_health import BrokerHealth, error_text, out_of_range_target


def test_an_idle_connection_closing_is_not_an_outage_but_all_brokers_down_is():
    health = BrokerHealth("test client")
    assert not health.on_client_error(KafkaError(KafkaError._TRANSPORT, "idle disconnect"))
    assert health.error is None and health.since is None
    assert health.on_client_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers down"))
    assert health.error == "1/1 brokers down" and health.since is not None
    since = health.since
    health.unreachable("still down")  # the outage's start stays the first report's
    assert health.error == "still down" and health.since == since
    health.reachable()
    assert health.error is None and health.since is None


def test_a_failed_request_over_a_broken_connection_is_an_outage():
    health = BrokerHealth("test client")
    assert not health.on_request_error(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too big"))
    assert health.error is None
    assert health.on_request_error(KafkaError(KafkaError._TRANSPORT, "connection refused"))
    assert health.error == "connection refused"


def test_out_of_range_continues_at_the_end_of_a_truncated_log_or_the_start_after_retention():
    lost = out_of_range_target(position=120, low=0, high=100)
    assert (lost.offset, lost.cause) == (100, "truncated")
    deleted = out_of_range_target(position=5, low=40, high=100)
    assert (deleted.offset, deleted.cause) == (40, "retention")


def test_error_text_is_librdkafkas_message():
    exc = KafkaException(KafkaError(KafkaError._TIMED_OUT, "ListOffsets timed out"))
    assert error_text(exc) == "ListOffsets timed out"
    assert error_text(RuntimeError("plain")) == "plain"
