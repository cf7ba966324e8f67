"""Suite-wide Kafka fixtures (one broker per test worker, a fresh topic per test), markers, order.

Set ``ODL_KAFKA_BOOTSTRAP=host:port`` to run against an external broker instead of the
embedded one. Topics made by ``kafka_topic_factory`` are unique per test and deleted after it
on either broker.

Every test that uses ``kafka_bootstrap`` or ``kafka_topic_factory`` is marked ``kafka``
here; tests that start a broker of their own carry the mark themselves. ``pytest -m "not
kafka"`` is the unit run: no broker is started.
"""

from __future__ import annotations

import collections
import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from odl.broker.embedded_broker import EmbeddedBroker
from odl.harness.topic_records import delete_topics
from odl.kafka.topic_admin import create_topic

EXTERNAL_BOOTSTRAP_ENV = "ODL_KAFKA_BOOTSTRAP"
KAFKA_FIXTURES = frozenset({"kafka_bootstrap", "kafka_topic_factory"})


def pytest_configure(config: pytest.Config) -> None:
    """In-process trainers and serving use odl's default thread rule (as the CLIs do)."""
    from odl.train.torch_runtime import configure_torch_threads

    configure_torch_threads(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``kafka`` every test that uses a broker fixture; puts the heaviest files first.

    ``make test`` runs files on two workers (``-n 2 --dist loadfile``), each taken in this
    order: the files with the most ``slow`` tests start at once and the short ones fill in
    around them, so no long file is left to run alone at the end.
    """
    for item in items:
        if KAFKA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: the order within a file is kept


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address of the session's broker (external if ODL_KAFKA_BOOTSTRAP is set)."""
    external = os.environ.get(EXTERNAL_BOOTSTRAP_ENV)
    if external:
        yield external
        return
    broker = EmbeddedBroker(port=0, data_dir=tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def kafka_topic_factory(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """Makes unique topics: ``make(partitions=1, prefix="t", config=None, create=True)``."""
    created: list[str] = []

    def make(
        partitions: int = 1,
        prefix: str = "t",
        config: dict[str, str] | None = None,
        create: bool = True,
    ) -> str:
        name = f"odl-test-{prefix}-{uuid.uuid4().hex[:12]}"
        created.append(name)  # also names handed out uncreated: the test may create them
        if create:
            create_topic(kafka_bootstrap, name, partitions, config=config)
        return name

    yield make
    # deleted after the test on every broker (see delete_topics)
    delete_topics(kafka_bootstrap, created)


OSS_TEST_SECRET = "oss-test-secret-never-logged"


@pytest.fixture
def oss(tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A loopback OSS test double; this process and its children are pointed at it.

    Sets ``OSS_ACCESS_KEY_ID`` / ``OSS_ACCESS_KEY_SECRET`` / ``OSS_ENDPOINT``, a fresh
    ``ODL_CACHE_DIR`` and a short ``ODL_OSS_RETRY_SECONDS`` (2 s) for the test.
    """
    from odl.harness.oss_double import OssDouble
    from odl.storage.oss_credentials import reset_oss_configuration
    from odl.storage.oss_store import reset_oss_store

    with OssDouble() as double:
        monkeypatch.setenv("OSS_ACCESS_KEY_ID", "test-key-id")
        monkeypatch.setenv("OSS_ACCESS_KEY_SECRET", OSS_TEST_SECRET)
        monkeypatch.setenv("OSS_ENDPOINT", double.endpoint)
        monkeypatch.setenv("ODL_CACHE_DIR", os.path.join(str(tmp_path), "odl-cache"))
        monkeypatch.setenv("ODL_OSS_RETRY_SECONDS", "2")
        reset_oss_configuration()
        reset_oss_store()
        try:
            yield double
        finally:
            reset_oss_store()
