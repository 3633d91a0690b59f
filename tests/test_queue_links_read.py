"""The queues' links as the monitor reads them (blocks/queue_links.py, dashboard/page_data.read_links),
against a real Prefect server: one request for every queue, the same links Block.load gives, a
document edited elsewhere into a bad URL said and never drawn, and an unreadable server never taken
for "no links" (a form filled from that would save over the real ones)."""

from __future__ import annotations

import time
import uuid

import pytest

from prefect_launch.blocks.queue_links import QueueLinks
from prefect_launch.dashboard import api as A
from prefect_launch.dashboard import page_data
from prefect_launch.dashboard.api import Api


class CountedApi(Api):
    """The monitor's REST client, counting its POSTs (an instrument, not a stand-in)."""

    posts = 0

    def post(self, path, body=None):
        self.posts += 1
        return super().post(path, body)


def _patch_data(api: Api, block: str, data: dict) -> None:
    """Overwrite a saved block's data through Prefect's REST API, as the Prefect UI's block editor does
    (it knows nothing of the links' URL rules)."""
    doc = api.get(f"block_types/slug/{QueueLinks.get_block_type_slug()}/block_documents/name/{block}")
    r = api.http.patch(f"block_documents/{doc['id']}", json={"data": data, "merge_existing_data": False})
    r.raise_for_status()


@pytest.fixture()
def queues(prefect_server):
    u = uuid.uuid4().hex[:6]
    q = {"shared": f"GPU {u}", "shared2": f"gpu-{u}", "own": f"cpu-{u}", "bad": f"bad-{u}", "none": f"none-{u}"}
    QueueLinks(queue=q["shared"], links=[{"label": "Grafana <b>", "url": "https://grafana.example.com/d?a=1&b=2"}]).store()
    QueueLinks(queue=q["own"], links=[{"label": "Console", "url": "http://console.internal:8080/x"},
                                      {"label": "Logs", "url": "https://logs.example.com/"}]).store()
    QueueLinks(queue=q["bad"], links=[{"label": "ok", "url": "https://ok.example.com/"}]).store()
    return q


def test_every_queues_links_in_one_request_equal_what_block_load_gives(prefect_server, queues):
    api = CountedApi(prefect_server)
    names = list(queues.values())
    saved = QueueLinks.saved_data(api, names)
    assert api.posts == 1
    assert QueueLinks.block_name(queues["shared"]) == QueueLinks.block_name(queues["shared2"])  # one block for both
    assert set(saved) == {queues["shared"], queues["shared2"], queues["own"], queues["bad"]}
    for q in names:
        own = QueueLinks.for_queue(q)
        got = QueueLinks.from_saved(q, saved[q]) if q in saved else QueueLinks(queue=q, links=[])
        assert [(x.label, x.url) for x in got.links] == [(x.label, x.url) for x in own.links], q
    shown = page_data.read_links(tuple(names))
    assert shown == {q: QueueLinks.for_queue(q).html() for q in names if QueueLinks.for_queue(q).links}
    assert "Grafana &lt;b&gt;" in shown[queues["shared"]] and "a=1&amp;b=2" in shown[queues["shared"]]


def test_links_edited_elsewhere_into_a_bad_url_are_said_and_never_drawn(prefect_server, queues):
    api = Api(prefect_server)
    block = QueueLinks.block_name(queues["bad"])
    _patch_data(api, block, {"queue": queues["bad"], "links": [{"label": "x", "url": "javascript:alert(1)"}]})
    shown = page_data.read_links(tuple(queues.values()))
    bad = shown[queues["bad"]]
    assert bad.startswith("not shown: the saved links do not validate (links.0.url:") and block in bad
    assert "href" not in bad and "<" not in bad  # escaped text, no anchor
    assert "href=" in shown[queues["own"]]  # the other queues' links still drawn
    with pytest.raises(ValueError, match="do not validate .*fix or delete the block"):
        QueueLinks.for_queue(queues["bad"])  # not an empty set a form could save over


def test_an_unreachable_server_is_not_taken_for_no_links(prefect_server, queues):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_launch.local_server import free_port

    assert QueueLinks.for_queue(queues["own"]).links  # readable: its links
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        with pytest.raises(Exception) as got:
            QueueLinks.for_queue(queues["own"])
    assert not isinstance(got.value, AssertionError)


@pytest.mark.server  # its own server, stopped and started again
def test_the_kept_prefect_client_reads_again_after_its_server_restarts(tmp_path):
    """The monitor keeps one Prefect client per API URL (dashboard/api.prefect_client): with its
    server stopped a read fails without Prefect's minute of retries (the page then says why), and once a server answers on that URL again the
    same client reads, with no restart of the monitor."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_launch.local_server import free_port, local_prefect_server

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            with local_prefect_server(tmp_path / "home", port, export=False):
                client = A.prefect_client()
                client.create_work_pool(WorkPoolCreate(name="kept-client", type="launch-process"))
                assert page_data.read_waiting(("kept-client",)) == []
            t = time.monotonic()
            with pytest.raises(Exception) as down:
                page_data.read_waiting(("kept-client",))
            # not Prefect's retries of a client that has connected once (~65 s of backoff here): the page's
            # read gives up at once and says why; a bound on the retry policy, far from any speed
            assert time.monotonic() - t < 30
            assert "connect" in f"{type(down.value).__name__} {down.value}".lower()
            with local_prefect_server(tmp_path / "home", port, export=False):  # the same database, started again
                assert A.prefect_client() is client
                assert [p.name for p in client.read_work_pools()] == ["kept-client"]
                assert page_data.read_waiting(("kept-client",)) == []
    finally:
        A._CLIENTS.pop(url, None)
