"""Each actuator's start-up check: it reaches its target without changing anything, or says why not."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Sequence

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.aggregator.actuators.test_alertmanager import alertmanager  # noqa: F401 - the real one
from tests.aggregator.aggregator_process import SECRET, WebhookReceiver
from tests.loopback import free_port
from vigil.aggregator.actuators.actuator import DeliveryError
from vigil.aggregator.actuators.alertmanager import AlertmanagerActuator, AlertmanagerConfig
from vigil.aggregator.actuators.kubernetes import KubernetesActuator, KubernetesConfig
from vigil.aggregator.actuators.slurm import SlurmActuator, SlurmConfig
from vigil.aggregator.actuators.webhook import WebhookActuator, WebhookConfig

# scontrol ping's answers (Slurm 22.05 src/scontrol/scontrol.c, _print_ping)
UP = "Slurmctld(primary) at head is UP\n"
DOWN = "Slurmctld(primary) at head is DOWN\n*****************************************\n"


def slurm(answer: str | None) -> SlurmActuator:
    def run(argv: Sequence[str], timeout_seconds: float) -> str:
        assert list(argv[1:]) == ["ping"]
        if answer is None:
            raise subprocess.CalledProcessError(1, list(argv), DOWN, "")
        return answer

    return SlurmActuator(SlurmConfig(enabled=True), run=run)


def test_slurm_check_is_scontrol_ping() -> None:
    assert slurm(UP).check() == UP.strip()
    for answer in (DOWN, None, ""):
        with pytest.raises(DeliveryError, match="scontrol ping"):
            slurm(answer).check()


def test_webhook_check_is_any_http_answer_and_a_refused_connection_is_not() -> None:
    receiver = WebhookReceiver()
    try:  # the receiver has no OPTIONS handler: its 501 still proves it is there
        said = WebhookActuator(WebhookConfig(enabled=True, url=receiver.url), secret=SECRET).check()
        assert said.startswith("OPTIONS ") and "HTTP 501" in said
        assert not receiver.arrivals  # nothing delivered, nothing signed
    finally:
        receiver.close()
    nobody = WebhookActuator(WebhookConfig(enabled=True, url=f"http://127.0.0.1:{free_port()}/hook"), secret=SECRET)
    with pytest.raises(DeliveryError, match="OPTIONS"):
        nobody.check()


@pytest.fixture
async def api_server() -> AsyncIterator[str]:
    async def version(_: web.Request) -> web.Response:
        # The shape `kubectl get --raw /version` prints (Kubernetes 1.30)
        return web.json_response({
            "major": "1", "minor": "30", "gitVersion": "v1.30.2",
            "gitCommit": "39683505b630ff2121012f3c5b16215a1449d5ed", "gitTreeState": "clean",
            "buildDate": "2024-06-11T20:21:00Z", "goVersion": "go1.22.4", "compiler": "gc",
            "platform": "linux/amd64"})

    app = web.Application()
    app.router.add_get("/version/", version)  # the client asks for /version/
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def test_kubernetes_check_reads_the_api_servers_version(api_server: str) -> None:
    import asyncio

    act = KubernetesActuator(KubernetesConfig(enabled=True, api_url=api_server, timeout_seconds=5))
    try:
        assert await asyncio.to_thread(act.check) == "kubernetes API v1.30.2"
    finally:
        act.close()
    gone = KubernetesActuator(KubernetesConfig(enabled=True, api_url=f"http://127.0.0.1:{free_port()}",
                                               timeout_seconds=2))
    try:
        with pytest.raises(DeliveryError, match="kubernetes"):
            await asyncio.to_thread(gone.check)
    finally:
        gone.close()


@pytest.mark.external
def test_alertmanager_check_is_its_readiness(alertmanager: str) -> None:  # noqa: F811
    assert AlertmanagerActuator(AlertmanagerConfig(enabled=True, url=alertmanager)).check().endswith("ready")
    with pytest.raises(DeliveryError, match="-/ready"):
        AlertmanagerActuator(AlertmanagerConfig(enabled=True, url=f"http://127.0.0.1:{free_port()}")).check()
